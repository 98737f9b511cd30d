"""``torchrun --nproc-per-node N -m rankscope.trainer [flags]``: one training rank.

The garbage collector is off while torch imports (a million objects, none of them garbage: 0.5 s of
CPU a rank) and what was imported is frozen, so the interpreter's last collection at exit does not walk
it again (3 s for 8 ranks on 2 cores, between the last step and the job's end).
"""

import gc
import sys

gc.disable()
from rankscope.trainer.train import main  # noqa: E402

gc.freeze()
gc.enable()
status = main()
gc.freeze()  # the objects training made, too: the process ends here
sys.exit(status)
