from dspark.train.cli import main

main()
