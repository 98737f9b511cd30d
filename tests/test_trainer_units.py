"""Fast, in-process checks of the trainer's parts: configuration, fault grammar, layout, layers, data, FLOPs."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from rankscope.common import fault_spec
from rankscope.trainer.injector import Injector
from rankscope.trainer.checkpoint import SavedLayout
from rankscope.trainer.train_config import LAUNCHER_ONLY, ConfigError, TrainConfig, build_parser, flag, parse_args, rank_argv
from rankscope.trainer.torchrun import planned, torchrun_command
from rankscope.trainer.dataset import MicroBatches, TokenSource
from rankscope.trainer.flops import flops_per_token, mfu, peak_flops
from rankscope.trainer.layers import TPContext, vocab_parallel_cross_entropy
from rankscope.trainer.model import Attention, GPTStage, ModelArgs, count_parameters, init_weights
from rankscope.trainer.parallel_state import Layout


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-rank gloo world, so the model's layers run in this process."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# --- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"heads": 6, "tp": 4}, "--heads 6 is not divisible by --tp 4"),
        ({"layers": 3}, "--layers 3 is not divisible by --pp 2"),
        ({"global_batch": 12}, "--global-batch 12 is not divisible by --micro-batch 4 x --dp 2 = 8"),
        ({"vocab": 1001}, "--vocab 1001 is not divisible by --tp 2"),
        ({"hidden": 100}, "--hidden 100 is not divisible by --heads 8"),
        ({"nproc": 4}, "--nproc 4 does not equal tp*pp*dp"),
        ({"sequence_parallel": True, "seq": 127}, "--sequence-parallel needs --seq 127 divisible by --tp 2"),
        ({"ckpt_every": 5}, "--ckpt-every and --resume need --ckpt-dir"),
        ({"tp": 0}, "--tp must be at least 1"),
        ({"inject": "hang:rank=8,step=2"}, "rank=8 is not a rank of this 8-rank job"),
        ({"inject": "crash:rank=1,step=21"}, "step=21 is not a step of this 20-step run"),
    ],
)
def test_config_refuses_what_cannot_run(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("*", r"\*").replace("+", r"\+")):
        TrainConfig(**overrides).validate()


def test_default_config_is_the_8_rank_job() -> None:
    cfg = TrainConfig().validate()
    assert (cfg.tp, cfg.pp, cfg.dp, cfg.world_size) == (2, 2, 2, 8)
    assert cfg.num_microbatches * cfg.micro_batch * cfg.dp == cfg.global_batch


def test_dp_0_takes_dp_from_the_world_size() -> None:
    cfg = TrainConfig(tp=1, pp=2, dp=0, micro_batch=2, global_batch=12, inject="hang:rank=1,step=2").validate()
    assert cfg.resolved(6).dp == 3 and cfg.resolved(2).dp == 1
    assert parse_args(rank_argv(cfg)) == cfg  # the ranks get --dp=0 and resolve it themselves
    assert TrainConfig().resolved(8) == TrainConfig()


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        ({"dp": 0}, 6, "the job's 6 ranks are not a multiple of tp*pp = 2*2 = 4, so --dp 0 cannot choose"),
        ({"dp": 0}, 12, "ranks give dp 3: --global-batch 32 is not divisible by --micro-batch 4 x --dp 3 = 12"),
        ({"dp": 0, "inject": "crash:rank=5,step=2"}, 4, "rank=5 is not a rank of this 4-rank job"),
        ({"dp": 0, "nproc": 8}, 4, "--nproc 8 does not equal tp*pp*dp = 2*2*1 = 4"),
        ({}, 4, "tp*pp*dp = 2*2*2 = 8 ranks are needed but the job has 4; launch 8 or use --dp 0"),
    ],
)
def test_resolved_refuses_a_world_that_does_not_fit(overrides: dict, world: int, message: str) -> None:
    cfg = TrainConfig(**overrides).validate()  # what does not depend on dp was fine
    with pytest.raises(ConfigError, match=re.escape(message)) as exc:
        cfg.resolved(world)
    assert "\n" not in str(exc.value)


def test_dp_0_still_validates_what_does_not_depend_on_dp() -> None:
    with pytest.raises(ConfigError, match="--heads 6 is not divisible by --tp 4"):
        TrainConfig(dp=0, heads=6, tp=4).validate()
    with pytest.raises(ConfigError, match=r"--dp must be 0 \(auto"):
        TrainConfig(dp=-1).validate()
    with pytest.raises(ConfigError, match="hang: missing step"):
        TrainConfig(dp=0, inject="hang:rank=1").validate()


def test_rankscope_train_with_dp_0_needs_nproc() -> None:
    with pytest.raises(ConfigError, match=re.escape("--dp 0 (auto) needs --nproc")):
        planned(TrainConfig(dp=0))
    with pytest.raises(ConfigError, match="the job's 6 ranks are not a multiple of tp\\*pp"):
        planned(TrainConfig(dp=0, nproc=6))
    assert planned(TrainConfig(dp=0, nproc=4)).world_size == 4


def test_check_elastic_names_the_dp_values_that_cannot_run() -> None:
    cfg = TrainConfig(dp=0, micro_batch=2, global_batch=12).validate()
    assert cfg.check_elastic(1, 3) is cfg and cfg.check_elastic(6, 6) is cfg
    with pytest.raises(ConfigError, match=r"--global-batch 12 does not split into micro-batches of 2 at dp 4, 5$"):
        cfg.check_elastic(1, 6)
    with pytest.raises(ConfigError, match=r"--distributed-optimizer cannot run at dp 1\.\.2: .* cannot be re-sharded"):
        dataclasses.replace(cfg, distributed_optimizer=True).check_elastic(1, 2)
    assert dataclasses.replace(cfg, distributed_optimizer=True).check_elastic(2, 2)
    with pytest.raises(ConfigError, match=r"--dp 2 is fixed but the job may run at dp 1\.\.2; use --dp 0"):
        TrainConfig().check_elastic(1, 2)
    with pytest.raises(ConfigError, match="must be non-empty"):
        cfg.check_elastic(3, 2)


@pytest.mark.parametrize(
    ("saved", "now", "message"),
    [
        (SavedLayout(1, 2, 2, False), SavedLayout(1, 2, 1, False), None),  # plain AdamW state loads at any dp
        (SavedLayout(1, 2, 2, True), SavedLayout(1, 2, 2, True), None),
        (SavedLayout(1, 2, 3, True), SavedLayout(1, 2, 2, True),
         "step-00000006 was saved with --distributed-optimizer at dp 3: its optimizer shards are keyed by dp rank"),
        (SavedLayout(1, 2, 2, False), SavedLayout(1, 2, 2, True), "was saved without --distributed-optimizer; resume without it"),
        (SavedLayout(2, 2, 1, False), SavedLayout(1, 2, 2, False), "saved at tp 2 x pp 2, not tp 1 x pp 2; only dp may change"),
    ],
)  # fmt: skip
def test_a_checkpoint_loads_at_another_dp_only_without_zero1_shards(saved: SavedLayout, now: SavedLayout, message: str | None) -> None:
    if message is None:
        saved.check_loadable_at(now, "step-00000006")
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        saved.check_loadable_at(now, "step-00000006")


def test_parse_args_maps_every_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANKSCOPE_INJECT", raising=False)
    cfg = parse_args(["--tp", "1", "--pp", "4", "--dp", "2", "--micro-batch", "2", "--global-batch", "8",
                      "--sequence-parallel", "--window", "16", "--metrics-json", "m.json"])  # fmt: skip
    assert (cfg.tp, cfg.pp, cfg.dp, cfg.micro_batch, cfg.window) == (1, 4, 2, 2, 16)
    assert cfg.sequence_parallel and not cfg.distributed_optimizer
    assert cfg.metrics_json == Path("m.json")


def test_parse_args_takes_inject_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKSCOPE_INJECT", "nan:rank=3,step=4")
    assert parse_args([]).inject == "nan:rank=3,step=4"
    assert parse_args(["--inject", "crash:rank=1,step=2"]).inject == "crash:rank=1,step=2"


def test_parse_args_exits_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--heads", "3"])
    assert exc.value.code == 2
    assert "--heads 3 is not divisible by --tp 2" in capsys.readouterr().err


def _unlike_the_defaults(data: Path) -> TrainConfig:
    """A valid configuration in which every field differs from its default, so every flag is written."""
    data.write_bytes(bytes(64))
    cfg = TrainConfig(
        nproc=3, tp=3, pp=1, dp=1, layers=6, hidden=96, heads=6, ffn=192, seq=42, vocab=99, micro_batch=3, global_batch=9,
        steps=7, lr=-2.5e-4, weight_decay=0.0, clip_grad=-1.0, seed=-7, sequence_parallel=True, distributed_optimizer=True,
        parallel_block=True, window=5, bucket_mb=0.25, timeout=12.5, data=data, ckpt_dir=Path("-ckpt dir"), ckpt_every=2,
        resume=True, inject="straggler:rank=2,factor=1.25,from_step=2;hang:rank=1,step=7", metrics_json=Path("m=1.jsonl"),
        log_every=3,
    ).validate()  # fmt: skip
    same = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) == f.default]
    assert not same, f"give these fields a value unlike their default: {same}"
    return cfg


def test_the_ranks_argv_parses_back_to_the_same_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``rankscope train`` hands the ranks ``rank_argv(cfg)``: the ranks must read exactly ``cfg`` from it (launcher-only
    fields aside), including negative numbers, values with ``=`` and spaces, and an inject spec from the environment."""
    monkeypatch.delenv("RANKSCOPE_INJECT", raising=False)
    cfg = _unlike_the_defaults(tmp_path / "tokens.bin")
    argv = rank_argv(cfg)
    assert not any(arg.startswith("--nproc") for arg in argv)
    assert parse_args(argv) == dataclasses.replace(cfg, nproc=None)
    assert rank_argv(TrainConfig()) == []  # defaults are not repeated
    monkeypatch.setenv("RANKSCOPE_INJECT", "nan:rank=3,step=4")
    assert rank_argv(parse_args(["--glob", "64"])) == ["--global-batch=64", "--inject=nan:rank=3,step=4"]  # full spellings


def test_no_trainer_flag_can_be_read_as_a_torchrun_option(tmp_path: Path) -> None:
    """torchrun's parser classifies every ``--x`` token, also after ``-m module``, and refuses one that abbreviates
    several of its options (``--nproc``: ``--nproc-per-node``/``--nproc_per_node``); one that names or abbreviates a
    single option of its own would be taken for it. No flag handed to the ranks may be either."""
    from torch.distributed.run import get_args_parser

    torchrun = get_args_parser()
    options = [o for action in torchrun._actions for o in action.option_strings]
    handed = [flag(f) for f in dataclasses.fields(TrainConfig) if not f.metadata[LAUNCHER_ONLY]]
    clashes = {f: [o for o in options if o.startswith(f)] for f in handed}
    assert not {f: o for f, o in clashes.items() if o}
    assert [flag(f) for f in dataclasses.fields(TrainConfig) if f.metadata[LAUNCHER_ONLY]] == ["--nproc"]
    # And torchrun really hands a full command line over untouched.
    argv = rank_argv(_unlike_the_defaults(tmp_path / "tokens.bin"))
    parsed = torchrun.parse_args(torchrun_command(argv, 3)[3:])
    assert (parsed.nproc_per_node, parsed.module, parsed.training_script) == ("3", True, "rankscope.trainer")
    assert parsed.training_script_args == argv


# --- fault grammar ------------------------------------------------------------------------------


def test_fault_spec_parses_every_kind() -> None:
    parsed = fault_spec.parse(
        "straggler:rank=5,factor=1.3,from_step=4; hang:rank=2,step=9;crash:rank=1,step=3;"
        "nan:rank=0,step=2;slow_link:src=1,dst=5,delay_ms=20"
    )
    assert [f.kind for f in parsed] == ["straggler", "hang", "crash", "nan", "slow_link"]
    assert parsed[0].rank == 5 and parsed[0].factor == 1.3 and parsed[0].from_step == 4
    assert (parsed[4].src, parsed[4].dst, parsed[4].delay_ms) == (1, 5, 20.0)
    assert fault_spec.parse("") == []


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("slow:rank=1", "does not start with a known fault kind"),
        ("hang:rank=1", "hang: missing step"),
        ("hang:rank=1,step=x", "step='x' is not a whole number"),
        ("crash:rank=1,step=2,factor=2", "'factor=2' is not one of rank=, step="),
        ("crash:rank=1,rank=2,step=2", "rank given twice"),
        ("straggler:rank=1,factor=0.5,from_step=1", "must be a number above 1"),
        ("slow_link:src=1,dst=1,delay_ms=5", "src and dst must differ"),
    ],
)
def test_fault_spec_errors_name_the_problem_in_one_line(spec: str, problem: str) -> None:
    with pytest.raises(fault_spec.FaultSpecError) as exc:
        fault_spec.parse(spec)
    assert problem in str(exc.value) and "\n" not in str(exc.value)
    assert "straggler:rank=R,factor=F,from_step=S" in build_parser().format_help()  # where the message points


def test_injector_applies_only_this_ranks_faults() -> None:
    spec = fault_spec.parse("crash:rank=1,step=3;straggler:rank=1,factor=2,from_step=2;nan:rank=0,step=2;"
                        "slow_link:src=1,dst=5,delay_ms=30")  # fmt: skip
    one, zero = Injector(spec, rank=1), Injector(spec, rank=0)
    one.begin_step(1)
    assert not one.stretching
    one.begin_step(2)
    assert one.stretching and not one.poison(2) and zero.poison(2)
    assert one.link_delay(5) == pytest.approx(0.03) and one.link_delay(4) == 0.0 and zero.link_delay(5) == 0.0
    with pytest.raises(RuntimeError, match="injected crash: rank 1 at step 3"):
        one.begin_step(3)
    zero.begin_step(3)  # rank 0 has no crash


# --- layout -------------------------------------------------------------------------------------


def test_layout_follows_megatron_order() -> None:
    layout = Layout(tp=2, pp=2, dp=2)
    for rank in range(8):
        c = layout.coords(rank)
        assert layout.rank_of(c.tp, c.pp, c.dp) == rank
        assert rank == c.tp + c.dp * 2 + c.pp * 4
    groups = layout.groups()
    assert [groups[f"tp[{i}]"] for i in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [groups[f"dp[{i}]"] for i in range(4)] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [groups[f"pp[{i}]"] for i in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.group_names(5) == ("tp[2]", "pp[1]", "dp[3]")
    for rank in range(8):
        assert all(rank in groups[name] for name in layout.group_names(rank))


# --- model pieces -------------------------------------------------------------------------------

ARGS = ModelArgs(vocab=64, hidden=32, heads=4, ffn=64, layers=2, seq=16)


@pytest.mark.parametrize("parallel_block", [False, True])
def test_parameter_count_matches_the_model(one_rank: None, parallel_block: bool) -> None:
    args = ModelArgs(**{**vars(ARGS), "parallel_block": parallel_block})
    model = GPTStage(args, TPContext(None, False), 0, 1)
    real = sum(p.numel() for name, p in model.named_parameters() if name != "pos")
    assert count_parameters(args) == real


def test_weights_do_not_depend_on_the_stage_split(one_rank: None) -> None:
    whole = GPTStage(ARGS, TPContext(None, False), 0, 1)
    second = GPTStage(ARGS, TPContext(None, False), 1, 2)
    init_weights(whole, seed=7, num_layers=2)
    init_weights(second, seed=7, num_layers=2)
    for name, p in second.named_parameters():
        assert torch.equal(p, whole.get_parameter(name)), name


def test_sliding_window_attention(one_rank: None) -> None:
    tp = TPContext(None, False)
    x = torch.randn(2, ARGS.seq, ARGS.hidden)
    causal, wide = Attention(ARGS, tp), Attention(ModelArgs(**{**vars(ARGS), "window": ARGS.seq}), tp)
    for p in causal.parameters():
        torch.nn.init.normal_(p, std=0.2)
    wide.load_state_dict(causal.state_dict())
    torch.testing.assert_close(wide(x), causal(x))  # a window as long as the sequence is plain causal
    narrow = Attention(ModelArgs(**{**vars(ARGS), "window": 1}), tp)
    narrow.load_state_dict(causal.state_dict())
    b, s, h = x.shape  # window 1: every token attends to itself only, so the output is its own value
    v = causal.qkv(x).view(b, s, ARGS.heads, 3, ARGS.head_dim)[:, :, :, 2].reshape(b, s, h)
    torch.testing.assert_close(narrow(x), causal.proj(v))


def test_vocab_parallel_cross_entropy_matches_torch(one_rank: None) -> None:
    logits = torch.randn(5, 7, 64, requires_grad=True)
    target = torch.randint(64, (5, 7))
    ours = vocab_parallel_cross_entropy(logits, target, TPContext(None, False)).mean()
    (grad_ours,) = torch.autograd.grad(ours, logits)
    ref = F.cross_entropy(logits.view(-1, 64), target.view(-1))
    (grad_ref,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad_ours, grad_ref)


# --- data ---------------------------------------------------------------------------------------


def test_dp_replicas_split_the_same_global_batch() -> None:
    source = TokenSource(vocab=100, seq=8, seed=3)
    whole = MicroBatches(source, global_batch=8, micro_batch=2, dp_rank=0, dp=1)
    halves = [MicroBatches(source, global_batch=8, micro_batch=2, dp_rank=r, dp=2) for r in range(2)]
    expected = torch.cat([whole.get(step=3, microbatch=m)[0] for m in range(4)])
    got = torch.cat([h.get(step=3, microbatch=m)[0] for h in halves for m in range(2)])
    assert torch.equal(got, expected)
    inputs, targets = whole.get(step=3, microbatch=0)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert not torch.equal(whole.get(step=4, microbatch=0)[0], inputs)


def test_token_file_windows(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    window = TokenSource(vocab=1000, seq=16, seed=1, path=path).sample(5)
    assert window.shape == (17,) and torch.equal(window, torch.arange(int(window[0]), int(window[0]) + 17))
    with pytest.raises(ValueError, match="outside --vocab 500"):
        for i in range(50):
            TokenSource(vocab=500, seq=16, seed=1, path=path).sample(i)


# --- FLOPs --------------------------------------------------------------------------------------


def test_peak_flops_by_device_name() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Some Future GPU") is None
    assert mfu(1e6, ARGS, 8, None) is None


def test_flops_per_token_is_palm_6n_plus_attention() -> None:
    n = count_parameters(ARGS)
    assert flops_per_token(ARGS) == 6 * n + 12 * ARGS.layers * ARGS.heads * ARGS.head_dim * ARGS.seq
    assert math.isclose(mfu(1000.0, ARGS, 2, 1e12), 1000.0 * flops_per_token(ARGS) / 2e12)
