"""The bottom room: what every layer shares (errors, the engine manifest record, the padding rule, the CLI
parser, HF folder loading). Imports nothing above it."""
