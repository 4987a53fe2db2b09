from dflash_staged.cli import main

main()
