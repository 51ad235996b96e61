from dataclasses import dataclass


@dataclass
class AsyncEngineArgs:
    model: str
    served_model_name: str | None = None
    tokenizer: str | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool | None = None
    max_num_seqs: int | None = None
