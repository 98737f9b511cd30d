"""``torchrun --nproc-per-node N -m rankscope.trainer [flags]``: one training rank.

torch is imported with the garbage collector off and frozen (``frozen_imports``), and so is what
training made before the process ends, so that the interpreter's last collection at exit does not walk
it (3 s for 8 ranks on 2 cores, between the last step and the job's end).
"""

import gc
import sys

from rankscope.common.frozen_imports import frozen_imports

with frozen_imports():
    from rankscope.trainer.train import main

status = main()
gc.freeze()  # the objects training made, too: the process ends here
sys.exit(status)
