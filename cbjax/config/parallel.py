"""ParallelConfig: how one engine spreads over devices. (Data parallelism is a set of engines behind a router:
cbjax/data_parallel.py.)"""

import dataclasses

from cbjax.config import validation as check
from cbjax.config.section import Section


@dataclasses.dataclass(frozen=True)
class ParallelConfig(Section):
    # Tensor parallelism: parameters and KV heads split over this many devices (cbjax/runner/sharding.py).
    tensor_parallel_size: int = 1

    def checked(self) -> dict:
        return dict(tensor_parallel_size=check.integer("tensor_parallel_size", self.tensor_parallel_size, 1))
