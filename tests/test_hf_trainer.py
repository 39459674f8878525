"""ZeroIOTrainer: a Hugging Face Trainer script on zeroio with "auto" config (2 ranks, CPU).

The three 2-rank Trainer jobs (train + evaluate + reload best, resume, overlapped step) run
in one ``run_ranks`` call, each in its own output folder: a rank pays the transformers import
once. Each test asserts on its own job's results; a job that raised fails its test with the
rank's traceback, and the jobs after it (not run: a rank may have left a collective
half done) fail theirs naming it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from zeroio.errors import ConfigError
from zeroio.testing import run_ranks

pytest.importorskip("transformers")

AUTO_STAGE3 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {
        "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto", "warmup_type": "linear"}},
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": "auto",
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_gather_16bit_weights_on_model_save": True,
        "offload_optimizer": {"device": "cpu"},
    },
}


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256, max_position_embeddings=64,
        tie_word_embeddings=False))


def _datasets():
    from zeroio.cli.train.data import ByteTokenizer, TokenBlocks, builtin_corpus

    tokens = ByteTokenizer().encode(builtin_corpus())
    train = TokenBlocks(tokens[:12000], 32)
    evals = TokenBlocks(tokens[12000:12000 + 64 * 32], 32)  # 64 blocks: 4 full batches per rank
    return train, evals


def _args(out, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), per_device_train_batch_size=4, per_device_eval_batch_size=8,
                gradient_accumulation_steps=2, learning_rate=3e-3, max_steps=24, warmup_steps=2,
                logging_steps=4, report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    base.update(kw)
    return TrainingArguments(**base)


def _periodic_evals(history: list[dict]) -> dict[int, float]:
    """step -> eval_loss of the evaluations made during training (before the final summary)."""
    out = {}
    for h in history:
        if "train_runtime" in h:
            break
        if "eval_loss" in h:
            out[h["step"]] = h["eval_loss"]
    return out


def _trainer_job(out: str) -> dict:
    from zeroio.integrations.transformers import ZeroIOTrainer

    train, evals = _datasets()
    args = _args(out, eval_strategy="steps", eval_steps=8, save_strategy="steps", save_steps=8,
                 load_best_model_at_end=True, metric_for_best_model="eval_loss",
                 greater_is_better=True)  # the *worst* eval wins: reloading it is visible
    trainer = ZeroIOTrainer(model=_model(), args=args, train_dataset=train, eval_dataset=evals,
                            zeroio_config=AUTO_STAGE3)
    trainer.train()
    final_eval = trainer.evaluate()["eval_loss"]
    trainer.save_model(str(Path(out) / "final"))
    cfg = trainer.zeroio_engine.config
    return {
        "history": trainer.state.log_history,
        "best_checkpoint": trainer.state.best_model_checkpoint,
        "best_metric": trainer.state.best_metric,
        "final_eval": final_eval,
        "resolved": {
            "micro": cfg.train_micro_batch_size_per_gpu,
            "gas": cfg.gradient_accumulation_steps,
            "train_batch": cfg.train_batch_size,
            "clip": cfg.gradient_clipping,
            "opt": dict(cfg.optimizer.params),
            "sched": dict(cfg.scheduler.params),
            "stage": cfg.zero_optimization.stage,
        },
    }


def _jobs_body(root: str) -> dict:
    """In a rank: each job in order, in ``root/<job>``; job -> (True, result) or (False, why)."""
    import traceback

    res: dict = {}
    for name, job in (("trained", _trainer_job), ("resume", _resume_job),
                      ("overlap", _overlap_job)):
        if any(not ok for ok, _ in res.values()):
            res[name] = (False, f"not run: an earlier job failed ({sorted(res)})")
            continue
        try:
            res[name] = (True, job(str(Path(root) / name)))
        except Exception:  # noqa: BLE001 - reported to the job's test
            res[name] = (False, traceback.format_exc())
    return res


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return root, run_ranks(_jobs_body, 2, str(root), timeout=600)


def _job(jobs, name):
    """Every rank's result of job ``name``; a failed job fails the test with its traceback."""
    root, per_rank = jobs
    for rank, res in enumerate(per_rank):
        ok, payload = res[name]
        if not ok:
            pytest.fail(f"job {name} on rank {rank}:\n{payload}", pytrace=False)
    return root / name, [res[name][1] for res in per_rank]


@pytest.fixture(scope="module")
def trained(jobs):
    return _job(jobs, "trained")


@pytest.mark.slow
@pytest.mark.timeout(600)  # whichever runs first sets up all three jobs
def test_trainer_trains_evaluates_with_auto_config(trained):
    _, (r0, r1) = trained
    assert r0["final_eval"] == pytest.approx(r1["final_eval"], rel=1e-6)
    res = r0["resolved"]
    assert (res["micro"], res["gas"], res["train_batch"], res["stage"]) == (4, 2, 16, 3)
    assert res["clip"] == 1.0
    assert res["opt"]["lr"] == pytest.approx(3e-3)
    assert list(res["opt"]["betas"]) == pytest.approx([0.9, 0.999])
    assert res["opt"]["eps"] == pytest.approx(1e-8) and res["opt"]["weight_decay"] == 0.0
    assert res["sched"]["total_num_steps"] == 24 and res["sched"]["warmup_num_steps"] == 2
    train_losses = [h["loss"] for h in r0["history"] if "loss" in h]
    evals = _periodic_evals(r0["history"])
    assert len(train_losses) == 6
    assert train_losses[-1] < train_losses[0] - 0.3
    assert set(evals) == {8, 16, 24}
    assert evals[24] < evals[8]
    for h in r0["history"]:
        if "learning_rate" in h:  # the engine's schedule, as the Trainer reports it
            assert 0 < h["learning_rate"] <= 3e-3 + 1e-12


@pytest.mark.slow
@pytest.mark.timeout(600)  # whichever runs first sets up all three jobs
def test_trainer_reloads_best_and_saves_from_pretrained(trained):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, (r0, _) = trained
    evals = _periodic_evals(r0["history"])
    worst_step = max(evals, key=lambda s: evals[s])
    assert r0["best_checkpoint"] == str(out / f"checkpoint-{worst_step}")
    # load_best_model_at_end put the best (here: worst) weights back into the engine
    assert r0["final_eval"] == pytest.approx(r0["best_metric"], rel=1e-5)
    assert not math.isclose(r0["final_eval"], evals[24], rel_tol=1e-3)
    # save_model wrote a folder plain transformers loads; its eval loss, recomputed without
    # zeroio on the whole eval set, equals the Trainer's
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    _, evals_ds = _datasets()
    batch = evals_ds.batch(list(range(len(evals_ds))))
    with torch.no_grad():
        ref = model(**batch).loss.item()
    assert ref == pytest.approx(r0["final_eval"], rel=1e-4)
    # each periodic checkpoint holds a loadable model too
    best = load_file(Path(r0["best_checkpoint"]) / "model.safetensors")
    final = load_file(out / "final" / "model.safetensors")
    for k in best:
        torch.testing.assert_close(best[k], final[k])


def test_explicit_value_contradicting_training_arguments_raises(tmp_path):
    from zeroio.integrations.transformers import ZeroIOTrainer

    train, _ = _datasets()
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 5e-4}},
              "zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError) as err:
        ZeroIOTrainer(model=_model(), args=_args(tmp_path), train_dataset=train,
                      zeroio_config=config)
    msg = str(err.value)
    assert "train_micro_batch_size_per_gpu = 8" in msg and "per_device_train_batch_size" in msg
    assert "optimizer.params.lr = 0.0005" in msg and "learning_rate gives 0.003" in msg
    assert "gradient_clipping" not in msg  # 1.0 agrees with max_grad_norm
    assert err.value.key == "train_micro_batch_size_per_gpu"


def test_save_only_model_with_load_best_model_at_end_is_refused(tmp_path):
    from zeroio.integrations.transformers import ZeroIOTrainer

    train, evals = _datasets()
    args = _args(tmp_path, eval_strategy="steps", eval_steps=4, save_strategy="steps",
                 save_steps=4, load_best_model_at_end=True, save_only_model=True)
    with pytest.raises(ConfigError, match="save_only_model=True with load_best_model_at_end"):
        ZeroIOTrainer(model=_model(), args=args, train_dataset=train, eval_dataset=evals,
                      zeroio_config=AUTO_STAGE3)


def _resume_job(out: str) -> dict:
    from zeroio.integrations.transformers import ZeroIOTrainer

    train, _ = _datasets()

    def make():
        args = _args(out, max_steps=8, save_strategy="steps", save_steps=4, logging_steps=1)
        return ZeroIOTrainer(model=_model(), args=args, train_dataset=train,
                             zeroio_config=AUTO_STAGE3)

    full = make()
    full.train()
    resumed = make()  # a fresh model: everything must come back from checkpoint-4
    resumed.train(resume_from_checkpoint=str(Path(out) / "checkpoint-4"))
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (full, resumed)]
    return {"full": losses[0], "resumed": losses[1]}


@pytest.mark.slow
@pytest.mark.timeout(600)  # whichever runs first sets up all three jobs
def test_trainer_resume_from_checkpoint_retraces_the_run(jobs):
    _, (r0, _) = _job(jobs, "resume")
    assert len(r0["full"]) == len(r0["resumed"]) == 8
    # steps 5-8 after resuming from the engine checkpoint match the uninterrupted run
    assert r0["resumed"][4:] == pytest.approx(r0["full"][4:], rel=1e-5)
    assert r0["full"][-1] < r0["full"][0]


def _overlap_job(out: str) -> dict:
    """The same Trainer run with the host step overlapped into the next forward and without
    (stage 2 + CPU offload): per-step losses (the Trainer gathers them across ranks right
    after each step), the final eval and the final weights through the engine's API."""
    import copy

    import zeroio
    from zeroio.integrations.transformers import ZeroIOTrainer

    train, evals = _datasets()
    res = {}
    for overlap in (False, True):
        cfg = copy.deepcopy(AUTO_STAGE3)
        cfg["zero_optimization"] = {"stage": 2, "reduce_bucket_size": 4096,
                                    "offload_optimizer": {"device": "cpu"},
                                    "tiering": {"overlap_step": overlap}}
        args = _args(Path(out) / str(overlap), max_steps=8, logging_steps=1, save_strategy="no")
        trainer = ZeroIOTrainer(model=_model(), args=args, train_dataset=train,
                                eval_dataset=evals, zeroio_config=cfg)
        trainer.train()
        engine = trainer.zeroio_engine
        params = list(engine.module.parameters())
        with zeroio.zero.GatheredParameters(params):
            weights = torch.cat([p.detach().float().reshape(-1) for p in params])
        res[overlap] = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                        "eval": trainer.evaluate()["eval_loss"], "weights": weights.tolist(),
                        "overlapped": engine.partitioner.overlap_forward}
    return res


@pytest.mark.slow
@pytest.mark.timeout(600)  # whichever runs first sets up all three jobs
def test_trainer_with_the_overlapped_step_equals_the_plain_order(jobs):
    _, (r0, r1) = _job(jobs, "overlap")
    for r in (r0, r1):
        assert r[True]["overlapped"] and not r[False]["overlapped"]
        assert len(r[True]["losses"]) == 8
        assert r[True]["losses"] == pytest.approx(r[False]["losses"], rel=1e-6)
        assert r[True]["eval"] == pytest.approx(r[False]["eval"], rel=1e-6)
        torch.testing.assert_close(torch.tensor(r[True]["weights"]),
                                   torch.tensor(r[False]["weights"]), rtol=1e-6, atol=1e-7)
