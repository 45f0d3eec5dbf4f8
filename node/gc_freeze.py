"""`freeze_startup()`: what a process's start-up made, out of the garbage collector's
sight for as long as the process lives.

Start-up makes millions of objects (torch, the model, the tokenizer, FastAPI's routes)
that live as long as the process. Frozen (`gc.freeze`), a full collection under load
skips them, and stalls the loop that triggered it for a millisecond rather than a hundred.
They are unfrozen at exit: interpreter shutdown's last collection skips frozen objects
too, and an extension module whose objects it leaves behind (triton's nanobind types)
prints a "leaked" report of some sixty lines as the process ends.
"""

from __future__ import annotations

import atexit
import gc


def freeze_startup() -> None:
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
