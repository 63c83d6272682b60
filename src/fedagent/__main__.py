from fedagent.cli import main

main()
