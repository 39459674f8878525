"""Fine-tune a local causal LM with the stock Hugging Face Trainer and report speed and memory.

Written like a transformers example (HfArgumentParser, ``from_pretrained``,
``Trainer(...).train()``), so it runs unchanged under DeepSpeed or, through the
``deepspeed`` facade, on zeroio::

    zeroio launch --nproc 1 benchmarks/hf_finetune.py --make_model \\
        --model_name_or_path /tmp/llama-1b --deepspeed benchmarks/hf_finetune_zero3_offload.json \\
        --output_dir /tmp/hf_finetune --bf16 --max_steps 6 --per_device_train_batch_size 4 \\
        --seq_len 1024 --logging_steps 1 --save_strategy no --report_to none

``--make_model`` first writes a ~1.2B-parameter Llama (Llama-3.2-1B's shape: hidden 2048,
16 layers, 32 heads / 8 KV heads, vocab 128256, tied embeddings) with random bf16 weights
into ``--model_name_or_path`` when that folder has no config.json (nothing is downloaded).
The data are random token blocks. Rank 0 prints one JSON line: seconds per optimizer step
(mean over the steps after the first), peak GPU memory (``torch.cuda.max_memory_allocated``)
and peak host resident memory of the process (``ru_maxrss``), per rank 0.
"""

import gc
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


@dataclass
class BenchArguments:
    model_name_or_path: str = field(metadata={"help": "a local model folder"})
    make_model: bool = field(default=False, metadata={"help": "write a random ~1.2B Llama there first"})
    seq_len: int = field(default=1024)
    num_samples: int = field(default=512)


def make_model(folder: Path) -> None:
    if (folder / "config.json").exists():
        return
    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         rope_theta=500000.0, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)


class RandomBlocks(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times = []
        self._t = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t)


def main():
    parser = HfArgumentParser((BenchArguments, TrainingArguments))
    bench, args = parser.parse_args_into_dataclasses()
    if bench.make_model:
        with args.main_process_first(desc="make model"):
            make_model(Path(bench.model_name_or_path))
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(bench.model_name_or_path, dtype=dtype)
    data = RandomBlocks(bench.num_samples, bench.seq_len, model.config.vocab_size)
    timer = StepTimer()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[timer])
    trainer.train()
    steady = timer.times[1:] or timer.times
    if args.process_index == 0:
        print(json.dumps({
            "steps": len(timer.times),
            "s_per_step": sum(steady) / len(steady),
            "step_times_s": timer.times,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
            "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "world_size": args.world_size,
            "train_loss": trainer.state.log_history[-1].get("train_loss"),
        }), flush=True)
    if torch.distributed.is_initialized():
        # Leave the gloo group in order: drop the trainer (its DDP wrapper holds the group)
        # while the group is alive, let both gloo worker threads finish releasing the last
        # gather (two barriers), then destroy it. Torn down at interpreter exit instead, the
        # group's destructor can wait on a worker that waits for the GIL it holds.
        del trainer
        gc.collect()
        torch.distributed.barrier()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
