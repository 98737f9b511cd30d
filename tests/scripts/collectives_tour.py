"""Every kind of torch.distributed operation once, each checked for its result, on gloo.

Launched by torchrun, or as plain processes (``--rank R --world N --port P``: then no RANK or
TORCHELASTIC_RUN_ID exists, the agent starts after init_process_group and the ranks agree on a
run id through the store). Prints "tour ok" at the end.
"""

import argparse

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int)
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    if args.port:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world)
    else:
        dist.init_process_group("gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, 1], group_desc="pair")
    total = float(sum(range(n)))

    t = torch.full((4,), float(r))
    dist.all_reduce(t)
    assert t.tolist() == [total] * 4
    work = dist.all_reduce(t, async_op=True)
    assert work.wait() and work.is_completed() and t.tolist() == [total * n] * 4
    parts = [torch.empty(2) for _ in range(n)]
    dist.all_gather(parts, torch.full((2,), float(r)))
    assert [p[0].item() for p in parts] == list(map(float, range(n)))
    flat = torch.empty(2 * n)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(r)))
    mine = torch.empty(2)
    dist.reduce_scatter_tensor(mine, torch.ones(2 * n))
    assert mine.tolist() == [float(n)] * 2
    dist.broadcast(t, src=0)
    dist.reduce(torch.ones(1), dst=0)
    dist.gather(torch.ones(1), [torch.empty(1) for _ in range(n)] if r == 0 else None, dst=0)
    got = torch.empty(1)
    dist.scatter(got, [torch.full((1,), float(i)) for i in range(n)] if r == 0 else None, src=0)
    assert got.item() == r
    swapped = torch.empty(n)
    dist.all_to_all_single(swapped, torch.full((n,), float(r)))
    assert swapped.tolist() == list(map(float, range(n)))
    objects: list[object] = [None] * n
    dist.all_gather_object(objects, {"rank": r})
    assert objects == [{"rank": i} for i in range(n)]
    dist.barrier()

    after, before = (r + 1) % n, (r - 1) % n  # a ring: send to the next rank, receive from the previous
    received = torch.empty(3)
    ops = [dist.P2POp(dist.isend, torch.full((3,), float(r)), after), dist.P2POp(dist.irecv, received, before)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    assert received.tolist() == [float(before)] * 3
    if r % 2 == 0:
        dist.send(torch.full((5,), float(r)), after)
        dist.recv(received.resize_(5), before)
    else:
        dist.recv(received.resize_(5), before)
        dist.send(torch.full((5,), float(r)), after)
    if r in (0, 1):
        dist.all_reduce(torch.ones(1), group=pair)
    try:  # an error raised inside the operation reaches the caller unchanged
        dist.group.WORLD.allreduce([torch.ones(1)], "not an option")
    except TypeError:
        pass
    else:
        raise AssertionError("a bad argument was accepted")
    dist.destroy_process_group()
    print("tour ok", r, flush=True)


if __name__ == "__main__":
    main()
