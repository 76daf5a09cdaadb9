"""Tensor parallelism over torch.distributed: one model split over K processes (ranks), Megatron-style.

    torchrun --nproc-per-node 3 -m minilade.generate --ckpt model.gguf "prompt"     # the command line
    llm = LLM.load("model.gguf", tensor_parallel=True)                              # in a script torchrun runs

plan.py    which rows or columns of each tensor a rank holds, and the rank counts a model allows
load.py    each rank reads only its part from safetensors or GGUF, and builds its Transformer
layers.py  the sums after wo and w_down and the vocabulary-split head that join the ranks' Transformers
group.py   the process group (from torchrun's environment, with a timeout) and its collectives

Every strategy runs unchanged on top: the collectives leave the same bits on every rank, so every rank reads the
same logits and decides the same tokens; the seed and auto's step costs come from rank 0.
"""

from .group import TensorParallelError, end_run, init_tensor_parallel, launched_with_ranks
from .layers import from_rank0, is_leader, process_group, quiet_unless_leader, read_on_leader
from .load import load_shard
from .plan import ShardPlan, valid_rank_counts

__all__ = ["ShardPlan", "TensorParallelError", "end_run", "from_rank0", "init_tensor_parallel", "is_leader",
           "launched_with_ranks", "load_shard", "process_group", "quiet_unless_leader", "read_on_leader",
           "valid_rank_counts"]
