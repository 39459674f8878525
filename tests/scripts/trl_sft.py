"""Supervised fine-tuning with TRL's SFTTrainer, in the style of trl/scripts/sft.py.

Runs under DeepSpeed with ``--deepspeed ds.json`` (the SFTConfig field) or plain DDP.
"""

import gc
from dataclasses import dataclass, field

import torch
from datasets import load_dataset
from transformers import AutoTokenizer, HfArgumentParser
from trl import SFTConfig, SFTTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a local model folder"})
    train_file: str = field(metadata={"help": "a text file, one example per line"})


def main():
    parser = HfArgumentParser((ScriptArguments, SFTConfig))
    script_args, training_args = parser.parse_args_into_dataclasses()
    dataset = load_dataset("text", data_files={"train": script_args.train_file})
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    trainer = SFTTrainer(
        model=script_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset["train"],
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
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
    main()
