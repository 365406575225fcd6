from engramdb.cli import main

main()
