"""`python -m llmtrain`: the same as the `llmtrain` command."""

from llmtrain.cli import main

main()
