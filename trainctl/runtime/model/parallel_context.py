"""What the model's layers know of the parallel layout: one object, handed down from `build_stage`.

The trainer makes it from the rank's process groups; a single-process build (tests, benchmarks, the Hugging
Face round trip) uses `ParallelContext()`, under which every parallel layer is a plain layer. Layers that
only split over TP (linears, norms, the router) take its `tp`; the rest take the whole context.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainctl.model_shape import ModelShape
from trainctl.runtime.model.moe import EPContext, MoEContext
from trainctl.runtime.parallel.context_parallel import CPContext
from trainctl.runtime.parallel.process_groups import Parallel
from trainctl.runtime.parallel.tensor_parallel import TPContext


@dataclass(frozen=True)
class ParallelContext:
    """This rank's tensor-parallel group, context-parallel group and MoE state (None: a dense model)."""

    tp: TPContext = field(default_factory=TPContext.single)
    cp: CPContext = field(default_factory=CPContext.single)
    moe: MoEContext | None = None

    @classmethod
    def of_rank(cls, par: Parallel, cfg: ModelShape, sequence_parallel: bool) -> ParallelContext:
        """The context of a rank of a running layout: its TP and CP groups, its experts and EP group."""
        tp = TPContext.from_group(par.tp_group, sequence_parallel) if par.tp > 1 else TPContext.single()
        moe = (MoEContext.build(cfg, EPContext(par.ep_group, par.ep, par.ep_rank))
               if cfg.moe is not None else None)
        return cls(tp=tp, cp=CPContext.from_group(par.cp_group), moe=moe)

    def with_all_experts(self, cfg: ModelShape) -> ParallelContext:
        """An MoE model built without an MoE context (one process, the meta-device builds) holds every
        expert."""
        if cfg.moe is not None and self.moe is None:
            return replace(self, moe=MoEContext.single(cfg))
        return self
