"""The `hf-moe-offload` command line: the parser (`main`), one module per subcommand that has no other home
(`train`, `generate`, `estimate`), the flags generated from dataclasses (`flags`) and docs/reference.md generated from
both (`reference`). Subcommands that live with their feature (`convert`, `push`, `export-adapter`, `check-adapter`)
register themselves from fairseq/ and hub/. A command reads flags, calls the library and prints; the work lives below.

May import: `data`, `distributed`, `errors`, `fairseq`, `families`, `hub`, `jobs`, `offload`, `planning`.
"""
