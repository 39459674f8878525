"""Train a causal LM with a hand-written accelerate loop, in the style of accelerate's
examples/by_feature/deepspeed_with_config_support.py.

The DeepSpeed side comes from the accelerate config (``distributed_type: DEEPSPEED``
with ``deepspeed_config_file``) under ``accelerate launch``, or from a ``DeepSpeedPlugin`` built
in the script (``--deepspeed_config_file``) under DeepSpeed's launcher, which also passes
``--local_rank``; without either the same loop runs as plain DDP (``--cpu`` on a host without GPUs).
Writes ``losses.json`` (the loss of every micro-batch, mean over ranks) and the
model (``save_pretrained`` with ``accelerator.get_state_dict``).
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, set_seed
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_scheduler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", required=True)
    p.add_argument("--train_file", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--per_device_train_batch_size", type=int, default=2)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--max_train_steps", type=int, default=4)
    p.add_argument("--block_size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="train on the CPU (no DeepSpeed then)")
    p.add_argument("--deepspeed_config_file", default=None, help="a DeepSpeed JSON for the plugin")
    p.add_argument("--local_rank", type=int, default=-1, help="passed by DeepSpeed's launcher")
    return p.parse_args()


def main():
    args = parse_args()
    plugin = (DeepSpeedPlugin(hf_ds_config=args.deepspeed_config_file, zero3_init_flag=True)
              if args.deepspeed_config_file else None)
    accelerator = Accelerator(cpu=args.cpu, deepspeed_plugin=plugin,
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)

    raw = load_dataset("text", data_files={"train": args.train_file})["train"]
    ids = [t for line in raw["text"] for t in tokenizer(line)["input_ids"]]
    n = len(ids) // args.block_size
    blocks = [ids[i * args.block_size:(i + 1) * args.block_size] for i in range(n)]
    data = [{"input_ids": torch.tensor(b), "labels": torch.tensor(b)} for b in blocks]
    loader = DataLoader(data, batch_size=args.per_device_train_batch_size, shuffle=False,
                        collate_fn=default_data_collator)

    ds_config = (accelerator.state.deepspeed_plugin.deepspeed_config
                 if accelerator.state.deepspeed_plugin is not None else {})
    optimizer_cls = DummyOptim if "optimizer" in ds_config else torch.optim.AdamW
    optimizer = optimizer_cls(model.parameters(), lr=args.learning_rate)
    if "scheduler" in ds_config:
        scheduler = DummyScheduler(optimizer, total_num_steps=args.max_train_steps, warmup_num_steps=0)
    else:
        scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0,
                                  num_training_steps=args.max_train_steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    losses, step = [], 0
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            losses.append(accelerator.gather(loss.detach()).mean().item())
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            if step >= args.max_train_steps:
                break

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save,
                              state_dict=accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "losses.json"), "w") as f:
            json.dump(losses, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
