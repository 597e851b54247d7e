"""The sizes `infinity tune` and `infinity demo` move data in.

The parser in infinity.cli.main checks its byte arguments against them, and the subcommands move
data in them; they live here, below both, so that a subcommand needs nothing from the parser's
module (which imports the subcommands) and the parser need not load a subcommand (and torch with
it) to know a size.
"""

from __future__ import annotations

# One op of the tune probe.
TUNE_OP_BYTES = 64 << 20
# One tensor of the demo's I/O part.
DEMO_TENSOR_BYTES = 64 << 20
