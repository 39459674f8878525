"""Preference optimisation with TRL's DPOTrainer, in the style of trl/scripts/dpo.py.

Runs under DeepSpeed with ``--deepspeed ds.json`` (the DPOConfig field) or plain DDP;
the reference model is built by the trainer from the same folder.
"""

import gc
from dataclasses import dataclass, field

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import DPOConfig, DPOTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a local model folder"})
    train_file: str = field(metadata={"help": "a JSON-lines file of prompt/chosen/rejected"})


def main():
    parser = HfArgumentParser((ScriptArguments, DPOConfig))
    script_args, training_args = parser.parse_args_into_dataclasses()
    dataset = load_dataset("json", data_files={"train": script_args.train_file})
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
    trainer = DPOTrainer(
        model=model,
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
