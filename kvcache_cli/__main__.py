from kvcache_cli.cli import main

main()
