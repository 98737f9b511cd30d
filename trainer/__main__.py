"""``torchrun --nproc-per-node N -m rankscope.trainer [flags]``: one training rank."""

import sys

from rankscope.trainer.train import main

sys.exit(main())
