"""The bundled Megatron-style GPT trainer: tensor, pipeline and data parallelism on torch.distributed.

Every critical segment and collective has a name the diagnosis can point at, and faults can be
injected for real (see ``injector``). ``rankscope train`` launches it; torchrun runs
``python -m rankscope.trainer`` with the same flags.
"""
