"""Fine-tune a causal language model on a text file with the Hugging Face Trainer.

Written the way transformers' examples/pytorch/language-modeling/run_clm.py is
(HfArgumentParser with model/data/training dataclasses, tokenizer and model
from_pretrained, resize_token_embeddings, group_texts, train with
resume_from_checkpoint, evaluate, save_model), so that it runs unchanged under
DeepSpeed (``--deepspeed ds.json``) or plain DDP. ``--generate_after`` also
samples a few tokens per rank with ``synced_gpus`` (as DeepSpeed ZeRO-3 needs).
"""

import gc
import json
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain

import torch
from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    set_seed,
)
from transformers.integrations import is_deepspeed_zero3_enabled


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a local model folder"})
    tokenizer_name: str | None = field(default=None)
    generate_after: bool = field(default=False, metadata={"help": "sample with synced_gpus"})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "a text file"})
    validation_file: str | None = field(default=None)
    block_size: int = field(default=32)


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    set_seed(training_args.seed)

    data_files = {"train": data_args.train_file}
    if data_args.validation_file:
        data_files["validation"] = data_args.validation_file
    raw = load_dataset("text", data_files=data_files)

    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)

    embedding_size = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embedding_size:
        model.resize_token_embeddings(len(tokenizer))

    def tokenize(examples):
        return tokenizer(examples["text"])

    with training_args.main_process_first(desc="tokenize"):
        tokenized = raw.map(tokenize, batched=True, remove_columns=["text"])

    block = data_args.block_size

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples.keys()}
        total = (len(joined["input_ids"]) // block) * block
        return {k: [t[i: i + block] for i in range(0, total, block)] for k, t in joined.items()}

    with training_args.main_process_first(desc="group"):
        lm = tokenized.map(group_texts, batched=True)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=lm["train"] if training_args.do_train else None,
        eval_dataset=lm["validation"] if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )

    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = result.metrics
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["perplexity"] = math.exp(metrics["eval_loss"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if model_args.generate_after:
        rank = training_args.process_index
        # ranks stop at different lengths: without synced_gpus a ZeRO-3 rank would hang
        prompt = tokenizer("the", return_tensors="pt").to(training_args.device)
        with torch.no_grad():
            out = trainer.model.generate(**prompt, max_new_tokens=4 + 3 * rank, do_sample=False,
                                         synced_gpus=is_deepspeed_zero3_enabled(),
                                         pad_token_id=tokenizer.pad_token_id)
        with open(os.path.join(training_args.output_dir, f"generated_rank{rank}.json"), "w") as f:
            json.dump({"ids": out[0].tolist(), "zero3": is_deepspeed_zero3_enabled()}, f)

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
