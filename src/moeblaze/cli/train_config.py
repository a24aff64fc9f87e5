"""`moeblaze train`'s run as one frozen config: the flags build it once (cli/train_flags.py), the machine's checks
resolve what the flags left to rule (cli/train_setup.py), and nothing after reads the command line. Torch-free.

Memory: none (a few scalars and the model's config).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..configs import EPConfig, ModelConfig


@dataclass(frozen=True)
class Schedule:
    """What the run trains on and for how long: steps, batch, optimizer and losses, evaluation, the seed."""
    steps: int = 1000
    batch_size: int = 16  # sequences per step, per process under torchrun
    seq_len: int = 128
    lr: float = 3e-3
    aux_loss_coef: float = 1e-2
    z_loss_coef: float = 1e-3
    eval_every: int = 250
    eval_batches: int = 8
    seed: int = 0

    @property
    def tokens(self) -> int:
        """Tokens per step on one process."""
        return self.batch_size * self.seq_len


@dataclass(frozen=True)
class Machine:
    """Where and how it computes: the device (None: chosen by the machine), the dtype, CPU threads, compile, graphs."""
    device: str | None = None
    dtype: str = "float32"
    threads: int | None = None
    compile: bool = False
    cuda_graph: bool = False

    @property
    def bf16(self) -> bool:
        return self.dtype == "bfloat16"


@dataclass(frozen=True)
class Parallel:
    """Expert parallelism and FSDP2 under torchrun. `ep` None, `keep_gathered` and `reduce_dtype` "auto": left to
    the layout's rule (cli/parallel.choose_layout). `on_overflow` "rerun" is the command's own (a CapacityTracker
    and a rerun of the step); ep_config then leaves the overflow unset. ep_config is the experts' EPConfig where ep
    > 1 (the flags build it whatever --ep says: the layout's rule may choose ep = N)."""
    ep: int | None = None
    ep_config: EPConfig = dataclasses.field(default_factory=EPConfig)
    on_overflow: str = "rerun"
    keep_gathered: str | bool = "auto"
    reduce_dtype: str = "auto"
    units: str = "blocks"

    @property
    def rerun(self) -> bool:
        return self.on_overflow == "rerun"


@dataclass(frozen=True)
class Outputs:
    """What the run writes and reads back: the checkpoint (None: the default path; "": none), the loss log."""
    save: str | None = None
    save_every: int = 250
    resume: bool = False
    overwrite: bool = False
    loss_log: str = ""


@dataclass(frozen=True)
class Bench:
    """--bench-steps: time `steps` steps after `warmup` and write a results row into the folder `results`."""
    steps: int = 0
    warmup: int = 3
    profile: bool = False
    trace: str | None = None
    results: str = "bench-results"


@dataclass(frozen=True)
class TrainConfig:
    """One `moeblaze train` run."""
    preset: str
    model: ModelConfig
    schedule: Schedule = Schedule()
    machine: Machine = Machine()
    parallel: Parallel = Parallel()
    outputs: Outputs = Outputs()
    bench: Bench = Bench()

    def replace(self, **parts) -> TrainConfig:
        """This config with some parts' fields replaced: replace(machine={"device": "cpu"})."""
        return dataclasses.replace(self, **{k: dataclasses.replace(getattr(self, k), **v) for k, v in parts.items()})
