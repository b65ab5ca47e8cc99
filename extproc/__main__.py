from extproc.cli import main

main()
