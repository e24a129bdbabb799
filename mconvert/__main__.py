from mconvert.cli import main

main()
