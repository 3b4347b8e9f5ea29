"""``python -m node`` ≡ the ``node`` console script."""

from node.cli.app import main

main()
