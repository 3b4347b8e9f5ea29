"""``python -m node`` ≡ the ``node`` console script."""

from node.cli import main

main()
