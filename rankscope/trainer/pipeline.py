"""One training step's forward and backward passes over micro-batches: the 1F1B pipeline schedule.

Stage s of P runs min(P - s - 1, M) warm-up forwards, then alternates one forward and one
backward (steady state), then drains the remaining backwards (cool-down), exchanging activations
and their gradients with its neighbours by point-to-point sends and receives. With P = 1 it is
plain gradient accumulation over M micro-batches.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from rankscope import agent
from rankscope.trainer import comm
from rankscope.trainer.dataset import MicroBatches
from rankscope.trainer.data_parallel import GradSync
from rankscope.trainer.injector import Injector
from rankscope.trainer.model import GPTStage
from rankscope.trainer.parallel_state import ParallelState


class Pipeline:
    """Runs the 1F1B schedule of one stage; ``run`` returns the summed micro-batch losses on the last stage."""

    def __init__(
        self,
        model: GPTStage,
        ps: ParallelState,
        data: MicroBatches,
        num_microbatches: int,
        micro_batch: int,
        device: torch.device,
        injector: Injector,
    ) -> None:
        self.model = model
        self.ps = ps
        self.data = data
        self.m = num_microbatches
        self.act_shape = model.activation_shape(micro_batch)
        self.device = device
        self.injector = injector
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
        )
        self.step = 0
        self.loss_sum: torch.Tensor | None = None
        #: micro-batches of this step whose output (activations, or the loss) held a NaN or infinity
        self.nonfinite = torch.zeros((), device=device)

    def run(self, step: int, sync: GradSync) -> torch.Tensor | None:
        """Forward and backward of every micro-batch of ``step``; gradients end accumulated, dp reduction started."""
        self.step = step
        self.loss_sum = torch.zeros((), device=self.device) if self.ps.is_last_stage else None
        self.nonfinite = torch.zeros((), device=self.device)
        warmup = min(self.ps.layout.pp - self.ps.coords.pp - 1, self.m)
        steady = self.m - warmup
        inputs: deque[torch.Tensor | None] = deque()
        outputs: deque[torch.Tensor] = deque()
        backward_index = 0

        def backward_next(grad: torch.Tensor | None) -> torch.Tensor | None:
            nonlocal backward_index
            if backward_index == self.m - 1:
                sync.arm()
            dx = self._backward(backward_index, inputs.popleft(), outputs.popleft(), grad)
            backward_index += 1
            return dx

        for i in range(warmup):
            x = self._p2p("recv_forward", recv_from=self.ps.prev_rank)
            y = self._forward(i, x)
            self._p2p("send_forward", send=y, send_to=self.ps.next_rank)
            inputs.append(x)
            outputs.append(y)
        x = self._p2p("recv_forward", recv_from=self.ps.prev_rank) if steady else None
        for i in range(steady):
            y = self._forward(warmup + i, x)
            inputs.append(x)
            outputs.append(y)
            grad = self._p2p("send_forward_recv_backward", send=y, send_to=self.ps.next_rank, recv_from=self.ps.next_rank)
            dx = backward_next(grad)
            if i == steady - 1:
                self._p2p("send_backward", send=dx, send_to=self.ps.prev_rank)
            else:
                x = self._p2p("send_backward_recv_forward", send=dx, send_to=self.ps.prev_rank, recv_from=self.ps.prev_rank)
        for _ in range(warmup):
            grad = self._p2p("recv_backward", recv_from=self.ps.next_rank)
            dx = backward_next(grad)
            self._p2p("send_backward", send=dx, send_to=self.ps.prev_rank)
        return self.loss_sum

    @contextlib.contextmanager
    def _compute(self, name: str, microbatch: int) -> Iterator[None]:
        """A compute span; an injected straggler stretches its own compute, not its waits in collectives.

        On CPU compute is the thread's CPU time (waits in collectives block without using it);
        on a GPU it is the synchronised wall time minus the time blocked in collectives.
        """
        with agent.span(name, kind="compute", step=self.step, microbatch=microbatch):
            if not self.injector.stretching:
                yield
                return
            if self.device.type != "cuda":
                cpu0 = time.thread_time()
                yield
                self.injector.stretch(time.thread_time() - cpu0, burn=True)
                return
            torch.cuda.synchronize(self.device)
            t0, blocked0 = time.perf_counter(), comm.blocked_seconds()
            yield
            torch.cuda.synchronize(self.device)
            self.injector.stretch(time.perf_counter() - t0 - (comm.blocked_seconds() - blocked0), burn=False)

    def _forward(self, microbatch: int, x: torch.Tensor | None) -> torch.Tensor:
        need_tokens = self.ps.is_first_stage or self.ps.is_last_stage
        if need_tokens:
            with agent.span("data", kind="data", step=self.step, microbatch=microbatch):
                tokens, targets = (t.to(self.device) for t in self.data.get(self.step, microbatch))
        with self._compute("forward", microbatch), self.autocast:
            y = self.model(tokens if self.ps.is_first_stage else x)
            if self.ps.is_last_stage:
                loss = self.model.loss(y, targets)
                self.loss_sum += loss.detach().float()  # type: ignore[operator]
                y = loss / self.m
            if self.injector.poison(self.step):
                y = y + float("nan")
            self.nonfinite += (~torch.isfinite(y.detach())).any()  # on the device: read once per step
        return y

    def _backward(
        self, microbatch: int, x: torch.Tensor | None, y: torch.Tensor, grad: torch.Tensor | None
    ) -> torch.Tensor | None:
        with self._compute("backward", microbatch):
            torch.autograd.backward(y, grad_tensors=grad)
        return None if x is None else x.grad

    def _p2p(
        self,
        name: str,
        send: torch.Tensor | None = None,
        send_to: int | None = None,
        recv_from: int | None = None,
    ) -> Any:
        """Exchange with pipeline neighbours (None: no neighbour on that side); returns the received tensor."""
        sends = [(send.detach().float().contiguous(), send_to)] if send is not None and send_to is not None else []
        buffer = None
        if recv_from is not None:
            buffer = torch.empty(self.act_shape, device=self.device)
        if not sends and buffer is None:
            return None
        with agent.span(name, kind="comm", step=self.step):
            comm.exchange(sends, [(buffer, recv_from)] if buffer is not None else [], self.ps.pp_group)
        if buffer is not None and name in ("recv_forward", "send_backward_recv_forward"):
            buffer.requires_grad_()
        return buffer
