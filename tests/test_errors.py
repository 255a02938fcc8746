"""The CLI's one error path, against a hostile battery: each case is a run of the CLI with one bad
input, and must end with exit code 2 and ONE line on stderr that names the field or file, with no
traceback (PITHTRAIN_DEBUG=1 shows it). Most cases call `cli.main` in-process (the whole CLI path,
without an interpreter start each); a few run `python -m pithtrain` to prove the exit code and the
absence of a traceback end to end."""

import contextlib
import errno
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from contextlib import contextmanager, nullcontext, redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from conftest import markov_docs, write_run_file
from pithtrain.cli import main

ROOT = Path(__file__).resolve().parents[1]

RUN_FILES = {  # run files: the tiny one, then one hostile edit
    "syntax": "CONFIG = RunConfig(\n",
    "import": "import no_such_module_xyz\n",
    "runtime": "CONFIG.model = type(CONFIG.model)(hidde_size=3)\n",
    "no_config": "del CONFIG\n",
    "steps_str": 'CONFIG.train.steps = "10"\n',
    "lr_str": 'CONFIG.optim.lr = "1e-3"\n',
    "hidden_float": "CONFIG.model.hidden_size = 32.0\n",
    "model_none": "CONFIG.model = None\n",
    "data_dict": "CONFIG.data = {'path': 'x'}\n",
    "pack_int": "CONFIG.data.pack_documents = 1\n",
    "layers_str": "CONFIG.model.mlp_only_layers = '0'\n",
    "lr_inf": "CONFIG.optim.lr = float('inf')\n",
    "field_typo": "CONFIG.optim.warmup = 3\n",
    "field_section": "CONFIG.train.lr = 1e-3\n",
    "exits": "import sys\nsys.exit(3)\n",
}

CASES = [  # (id, command line, what the one line must name)
    ("file-syntax", "train {syntax}", "syntax.py"),
    ("file-import", "train {import}", "no_such_module_xyz"),
    ("file-runtime", "train {runtime}", "hidde_size"),
    ("file-missing", "train {tmp}/missing.py", "missing.py"),
    ("file-no-config", "train {no_config}", "CONFIG"),
    ("type-steps-str", "train {steps_str}", "train.steps"),
    ("type-lr-str", "train {lr_str}", "optim.lr"),
    ("type-model-float", "train {hidden_float}", "model.hidden_size"),
    ("type-model-none", "train {model_none}", "model"),
    ("type-section-dict", "train {data_dict}", "data"),
    ("type-bool-int", "train {pack_int}", "data.pack_documents"),
    ("type-list-str", "train {layers_str}", "model.mlp_only_layers"),
    ("type-lr-inf-file", "train {lr_inf}", "optim.lr"),
    ("file-exits", "train {exits}", "exits.py:14: SystemExit: 3; fix the run file"),
    ("file-field-typo", "train {field_typo}", "optim.warmup: OptimConfig has no such field (did you mean optim.warmup_steps?)"),
    ("file-field-section", "train {field_section}", "train.lr: TrainConfig has no such field (did you mean optim.lr?)"),
    ("set-type", "train {cfg} --set train.steps=ten", "train.steps"),
    ("set-unknown", "train {cfg} --set train.stpes=3", "stpes"),
    ("set-other-family", "train {cfg} --set model.num_nextn_predict_layers=1", "DeepseekV3Config (another model family) has it"),
    ("set-single-quotes", "train {cfg} --set \"optim.muon_exclude=['embed*']\"", '["a","b"] (double-quoted strings)'),
    ("set-form", "train {cfg} --set train.steps", "train.steps"),
    ("set-no-field", "train {cfg} --set =1", "no field named"),
    ("steps-twice", "train {cfg} --steps 3 --set train.steps=4", "--steps 3 and --set train.steps=4 disagree"),
    ("ep-twice", "train {cfg} --ep 2 --set parallel.ep=1", "--ep 2 and --set parallel.ep=1 disagree"),
    ("hsdp-twice", "train {cfg} --hsdp --set parallel.hsdp=false", "--hsdp and --set parallel.hsdp=False disagree"),
    ("set-section", "train {cfg} --set optim=1", "set it in the run file"),
    ("file-dir", "train {tmp}", "is a directory"),
    ("file-toml", "train {tmp}/run.toml", "a run file is Python defining CONFIG = RunConfig(...), not TOML"),
    ("file-device", "train /dev/null", "'/dev/null' is not a regular file"),
    ("out-empty", "train {cfg} --out ''", "--out is empty"),
    ("data-path-empty", "train {cfg} --set data.path=", "data.path is empty"),
    ("data-path-tokens-bin", "train {cfg} --set data.path={data}/tokens.bin", "is a file of the dataset"),
    ("data-path-texts", "train {cfg} --set data.path={tmp}", "is not a pithtrain dataset; make one of its texts: pithtrain tokenize"),
    ("pp-empty-rank", "train {cfg} --nproc 4 --pp 4 --set train.micro_batch_size=1 --dry-run", "use at least 5 layers"),
    ("env-rank", "train {cfg}", "RANK='5' WORLD_SIZE='2'"),
    ("env-rank-nproc", "train {cfg} --nproc 4 --ep 2", "--nproc 4: RANK and WORLD_SIZE=2 are set"),
    ("env-master-port", "train {cfg}", "MASTER_PORT='abc'"),
    ("eval-samples-mesh", "train {cfg} --nproc 2 --set data.eval_samples=4 --set train.eval_every=1 --dry-run",
     "or train.micro_batch_size=2 (a resumed run keeps its held-out samples)"),
    ("batch-pp-fit", "train {cfg} --nproc 4 --pp 2 --set train.micro_batch_size=3 --dry-run",
     "or train.micro_batch_size=1 (a resumed run keeps its global batch)"),  # 2 would give pp 2 too few micro-batches
    ("data-path-twice", """train {cfg} --set 'data.path={{"{data}": 0.7, "{data}": 0.3}}'""", "appears twice"),
    ("eval-path-file", "train {cfg} --set data.eval_path={notes} --set train.eval_every=1", "is a file"),
    ("eval-path-npy", "train {cfg} --set data.eval_path={tokens} --set train.eval_every=1", "for `pithtrain eval --tokens`"),
    ("eval-path-npy-in-data", "train {cfg} --set data.eval_path={data_npy} --set train.eval_every=1", "for `pithtrain eval --tokens`"),
    ("lr-inf", "train {cfg} --set optim.lr=inf", "optim.lr"),
    ("lr-nan", "train {cfg} --set optim.lr=nan", "optim.lr"),
    ("lr-negative", "train {cfg} --set optim.lr=-1", "optim.lr"),
    ("flag-type", "train {cfg} --steps ten", "--steps"),
    ("flag-megatron", "train {cfg} --micro-batch-size 2", "config fields are set with --set, e.g. --set train.micro_batch_size=VALUE"),
    ("set-other-section", "train {cfg} --set train.lr=1e-3", "unknown field 'lr' here (did you mean optim.lr?)"),
    ("flag-missing-config", "train", "config"),
    ("experts-negative", "train {cfg} --set model.num_experts=-1", "model.num_experts"),
    ("expert-size-zero", "train {cfg} --set model.moe_intermediate_size=0", "model.moe_intermediate_size"),
    ("dense-size-negative", "train {cfg} --set model.intermediate_size=-4", "model.intermediate_size"),
    ("heads-zero", "train {cfg} --set model.num_attention_heads=0", "model.num_attention_heads"),
    ("head-dim-zero", "train {cfg} --set model.head_dim=0", "model.head_dim"),
    ("rope-theta-zero", "train {cfg} --set model.rope_theta=0", "model.rope_theta"),
    ("norm-eps-negative", "train {cfg} --set model.rms_norm_eps=-1e-6", "model.rms_norm_eps"),
    ("layers-zero", "train {cfg} --set model.num_hidden_layers=0", "model.num_hidden_layers"),
    ("positions-zero", "train {cfg} --set model.max_position_embeddings=0", "model.max_position_embeddings"),
    ("deepseek-expert-size", "train {deepseek} --set model.moe_intermediate_size=0", "model.moe_intermediate_size"),
    ("deepseek-rope-theta", "train {deepseek} --set model.rope_theta=-1", "model.rope_theta"),
    ("deepseek-v3-topk-group", "train {deepseek_v3} --set model.topk_group=9", "model.topk_group"),
    ("deepseek-v3-routing", "train {deepseek_v3} --set model.scoring_func=softmax", "model.scoring_func"),
    ("kimi-k25-no-text-config", "eval {hf_kimi_k25} --tokens {tokens}", "text_config"),
    ("deepseek-v3-topk-method", "train {deepseek_v3} --set model.topk_method=best", "model.topk_method"),
    ("mtp-coef-negative", "train {deepseek_v3} --set train.mtp_coef=-0.1", "train.mtp_coef"),
    ("mtp-depths-negative", "train {deepseek_v3} --set model.num_nextn_predict_layers=-1", "model.num_nextn_predict_layers"),
    ("mtp-beside-the-head", "train {deepseek_v3} --nproc 4 --pp 4 --set model.num_nextn_predict_layers=8 "
     "--set train.global_batch_size=64", "model.num_nextn_predict_layers"),
    ("mtp-deeper-than-the-sample", "train {deepseek_v3} --set model.num_nextn_predict_layers=8 --set data.seq_len=8",
     "depth 8 and deeper have no target"),
    ("eval-npy-seq-len", "eval {hf} --tokens {tokens} --seq-len 8", "--seq-len 8: "),
    ("eval-npy-max-tokens", "eval {hf} --tokens {tokens} --max-tokens 2", "fewer than one row"),
    ("gpt-oss-eps", "train {gpt_oss} --set model.rms_norm_eps=0", "model.rms_norm_eps"),
    ("gpt-oss-experts", "train {gpt_oss} --set model.num_local_experts=0", "model.num_local_experts"),
    ("qwen3-5-layer-types", "train {qwen3_5} --set model.layer_types=" + json.dumps(["linear_attention"] * 3 + ["mamba"], separators=(",", ":")),
     "model.layer_types"),
    ("qwen3-5-layer-count", "train {qwen3_5} --set model.layer_types=" + json.dumps(["full_attention"]), "model.layer_types"),
    ("qwen3-5-no-rotated-dims", "train {qwen3_5} --set model.partial_rotary_factor=0.01", "(it gives 0)"),
    ("qwen3-5-linear-heads", "train {qwen3_5} --set model.linear_num_key_heads=3", "model.linear_num_value_heads"),
    ("qwen3-5-conv-kernel", "train {qwen3_5} --set model.linear_conv_kernel_dim=0", "model.linear_conv_kernel_dim"),
    ("qwen3-5-multimodal-as-text", "eval {hf_mm_as_text} --tokens {tokens}", "model_type"),
    ("adam-eps-zero", "train {cfg} --set optim.eps=0", "optim.eps"),
    ("optim-name", "train {cfg} --set optim.name=sgd", "optim.name"),
    ("recompute-mode", "train {cfg} --set train.recompute=some", "train.recompute"),
    ("env-debug-memory", "train {cfg}", "PITHTRAIN_DEBUG_MEMORY"),  # environment variables of the skills
    ("env-debug-norms", "train {cfg}", "PITHTRAIN_DEBUG_NORMS"),
    ("env-profile-steps", "train {cfg}", "PITHTRAIN_PROFILE_STEPS"),
    ("muon-momentum", "train {cfg} --set optim.momentum=1", "optim.momentum"),
    ("muon-exclude-not-list", "train {cfg} --set optim.muon_exclude=lm_head", "optim.muon_exclude"),
    ("timeout-zero", "train {cfg} --set parallel.timeout_s=0", "parallel.timeout_s"),
    ("global-batch-zero", "train {cfg} --set train.global_batch_size=0", "train.global_batch_size"),
    ("micro-batch-zero", "train {cfg} --set train.micro_batch_size=0", "train.micro_batch_size"),
    ("steps-zero", "train {cfg} --steps 0", "train.steps"),
    ("seq-len-zero", "train {cfg} --set data.seq_len=0", "data.seq_len"),
    ("data-seed-negative", "train {cfg} --set data.seed=-1", "data.seed"),
    ("nproc-zero", "train {cfg} --nproc 0", "--nproc"),
    ("nproc-negative", "train {cfg} --nproc -2", "--nproc"),
    ("stop-after-zero", "train {cfg} --stop-after 0", "--stop-after"),
    ("ep-zero", "train {cfg} --ep 0", "parallel.ep"),
    ("device-cuda", "train {cfg} --set train.device=cuda", "train.device"),
    ("device-unknown", "train {cfg} --set train.device=tpu", "train.device"),
    ("data-missing", "train {cfg} --set data.path={tmp}/nowhere", "data.path"),
    ("data-file", "train {cfg} --set data.path={notes}", "data.path"),
    ("data-not-dataset", "train {cfg} --set data.path={tmp}", "meta.json"),
    ("data-unset", "train {cfg} --set data.path=", "data.path"),
    ("data-truncated", "train {cfg} --set data.path={data_truncated}", "tokens.bin"),
    ("data-bad-meta", "train {cfg} --set data.path={data_bad_meta}", "meta.json"),
    ("data-bad-ids", "train {cfg} --set data.path={data_bad_ids}", "tokens.bin"),
    ("data-vocab", "train {cfg} --set model.vocab_size=32", "vocab_size"),
    ("eval-every-negative", "train {cfg} --set train.eval_every=-1", "train.eval_every"),
    ("eval-every-no-data", "train {cfg} --set train.eval_every=5", "train.eval_every"),
    ("eval-samples-negative", "train {cfg} --set data.eval_samples=-4", "data.eval_samples"),
    ("eval-samples-indivisible", "train {cfg} --set data.eval_samples=3", "data.eval_samples"),
    ("eval-samples-too-many", "train {cfg} --set data.eval_samples=10000", "data.eval_samples"),
    ("eval-path-not-dataset", "train {cfg} --set train.eval_every=1 --set data.eval_path={tmp}", "data.eval_path"),
    ("eval-path-vocab", "train {cfg} --set train.eval_every=1 --set data.eval_path={data_big_vocab}", "data.eval_path"),
    ("eval-path-too-small", "train {cfg} --set train.eval_every=1 --set data.eval_samples=400 --set data.eval_path={data}", "data.eval_path"),
    ("out-under-file", "train {cfg} --out {notes}/run", "notes.txt"),
    ("out-is-file", "train {cfg} --out {notes}", "notes.txt"),
    ("out-dangling-link", "train {cfg} --out {dangling}", "dangling is a symbolic link to"),
    ("checkpoints-is-file", "train {cfg} --out {run_ckfile}", "checkpoints"),
    ("init-from-missing", "train {cfg} --set train.init_from={tmp}/nowhere", "train.init_from"),
    ("init-from-corrupt", "train {cfg} --set train.init_from={hf_junk}", "model.safetensors"),
    ("disk-full", "train {cfg} --out {run_full}", "ENOSPC"),
    ("resume-corrupt-metadata", "train {cfg} --out {run_bad}", "step_00000001"),
    ("resume-corrupt-meta-json", "train {cfg} --out {run_badmeta}", "meta.json"),
    ("eval-corrupt-checkpoint", "eval {run_bad} --tokens {tokens}", "step_00000001"),
    ("convert-truncated-checkpoint", "convert {run_nodata} {tmp}/hf_out", "step_00000001"),
    ("convert-junk-safetensors", "convert {hf_junk} {tmp}/ck_out", "model.safetensors"),
    ("eval-truncated-safetensors", "eval {hf_trunc} --tokens {tokens}", "model.safetensors"),
    ("convert-missing-shard", "convert {hf_shard} {tmp}/ck_out2", "model-00002-of-00002.safetensors"),
    ("hf-config-json", "eval {hf_badjson} --tokens {tokens}", "config.json"),
    ("hf-config-type", "eval {hf_badtype} --tokens {tokens}", "hidden_size"),
    ("hf-model-type", "convert {hf_llama} {tmp}/ck_out3", "model_type"),
    ("hf-shape", "eval {hf_shape} --tokens {tokens}", "model.norm.weight"),
    ("eval-tokens-text", "eval {hf} --tokens {notes}", "notes.txt"),
    ("eval-tokens-empty-file", "eval {hf} --tokens {empty_npy}", "empty.npy"),
    ("eval-tokens-1d", "eval {hf} --tokens {tokens_1d}", "tokens_1d.npy"),
    ("eval-tokens-float", "eval {hf} --tokens {tokens_float}", "tokens_float.npy"),
    ("eval-tokens-vocab", "eval {hf} --tokens {tokens_big}", "tokens_big.npy"),
    ("eval-tokens-negative", "eval {hf} --tokens {tokens_negative}", "(2, 5) with negative ids"),
    ("eval-tokens-bin", "eval {hf} --tokens {data}/tokens.bin", "not a .npy file: pass its dataset directory, "),
    ("eval-tokens-no-rows", "eval {hf} --tokens {tokens_none}", "tokens_none.npy"),
    ("eval-tokens-missing", "eval {hf} --tokens {tmp}/none.npy", "none.npy"),
    ("eval-batch-zero", "eval {hf} --tokens {tokens} --batch-size 0", "--batch-size"),
    ("eval-batch-negative", "eval {hf} --tokens {tokens} --batch-size -1", "--batch-size"),
    ("eval-device-cuda", "eval {hf} --tokens {tokens} --device cuda", "--device"),
    ("eval-device-unknown", "eval {hf} --tokens {tokens} --device tpu", "--device"),
    ("eval-model-missing", "eval {tmp}/nowhere --tokens {tokens}", "nowhere"),
    ("eval-no-checkpoints", "eval {empty_dir} --tokens {tokens}", "empty_dir"),
    ("eval-dataset-as-model", "eval {data} --tokens {tokens}", "data is a token dataset of `pithtrain tokenize`, not a model"),
    ("eval-tokens-not-dataset", "eval {hf} --tokens {empty_dir}", "a .npy file of token ids [batch, seq] or a dataset"),
    ("eval-seq-len", "eval {hf} --tokens {data} --seq-len 1", "--seq-len"),
    ("eval-max-tokens", "eval {hf} --tokens {data} --max-tokens 0", "--max-tokens"),
    ("tokenize-out-dataset", "tokenize {corpus} --train-tokenizer --out {data}", "--overwrite"),
    ("tokenize-not-tokenizer", "tokenize {corpus} --tokenizer {notes} --out {tmp}/t1", "notes.txt"),
    ("tokenize-vocab-zero", "tokenize {corpus} --train-tokenizer --vocab-size 0 --out {tmp}/t2", "--vocab-size"),
    ("tokenize-vocab-small", "tokenize {corpus} --train-tokenizer --vocab-size 100 --out {tmp}/t3", "--vocab-size"),
    ("tokenize-vocab-reserve", "tokenize {corpus} --train-tokenizer --vocab-size 4294967295 --out {tmp}/t3", "at most 2**24"),
    ("tokenize-vocab-huge", "tokenize {corpus} --train-tokenizer --vocab-size 99999999999999999999 --out {tmp}/t10", "--vocab-size"),
    ("tokenize-input-missing", "tokenize {tmp}/nope.txt --train-tokenizer --out {tmp}/t4", "nope.txt"),
    ("tokenize-out-foreign", "tokenize {corpus} --train-tokenizer --out {tmp}", "--out"),
    ("tokenize-no-inputs", "tokenize --train-tokenizer --out {tmp}/t5", "--stdlib"),
    ("tokenize-jsonl-field", "tokenize {jsonl} --train-tokenizer --out {tmp}/t6", "bad.jsonl"),
    ("tokenize-json-strings", "tokenize {json_strings} --train-tokenizer --out {tmp}/t8", "strings.json: item 0: a JSON string"),
    ("tokenize-tokenizer-device", "tokenize {json_strings} --tokenizer /dev/null --out {tmp}/t9",
     "--tokenizer /dev/null is not a regular file"),
    ("tokenize-max-bytes", "tokenize --stdlib --max-bytes 0 --train-tokenizer --out {tmp}/t7", "--max-bytes"),
    ("tokenize-max-bytes-no-stdlib", "tokenize {corpus} --max-bytes 100 --train-tokenizer --out {tmp}/t11", "only applies with --stdlib"),
    ("wandb-missing", "train {cfg} --set train.wandb_project=moe", "train.wandb_project"),
    ("dry-run-mesh", "train {cfg} --dry-run --nproc 2 --pp 2", "parallel.pp"),
    ("dry-run-data", "train {cfg} --dry-run --set data.path={tmp}/nowhere", "data.path"),
    ("plot-no-metrics", "plot {tmp}/run_good {empty_dir}", "empty_dir"),
    ("plot-out-unwritable", "plot {tmp}/run_good --out {notes}/x.png", "notes.txt"),
]

# in a real process (exit code, stderr) for train and convert; every case above already ran through cli.main here
END_TO_END = ("type-steps-str", "convert-junk-safetensors")


def _disk_full():
    """Every checkpoint data write fails as on a full disk (where DCP writes its files)."""
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return mock.patch("torch.distributed.checkpoint.filesystem._write_item", side_effect=full)


PATCHES = {"disk-full": _disk_full, "wandb-missing": lambda: mock.patch.dict(sys.modules, {"wandb": None}),
           "env-debug-memory": lambda: mock.patch.dict(os.environ, {"PITHTRAIN_DEBUG_MEMORY": "last"}),
           "env-debug-norms": lambda: mock.patch.dict(os.environ, {"PITHTRAIN_DEBUG_NORMS": "5-2"}),
           "env-profile-steps": lambda: mock.patch.dict(os.environ, {"PITHTRAIN_PROFILE_STEPS": "3"}),
           "env-rank": lambda: mock.patch.dict(os.environ, {"RANK": "5", "WORLD_SIZE": "2"}),
           "env-rank-nproc": lambda: mock.patch.dict(os.environ, {"RANK": "0", "WORLD_SIZE": "2"}),
           "env-master-port": lambda: mock.patch.dict(os.environ, {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "abc"})}


def make_env(tmp: Path) -> dict:
    """The battery's files: a tiny dataset and run file, an HF export, a run with one checkpoint,
    and broken copies of each."""
    from safetensors.torch import load_file, save_file

    from pithtrain.config import load_run_config
    from pithtrain.tools.hf import write_hf_dir
    from pithtrain.train import loop
    from pithtrain.train.data import write_dataset

    env = {"tmp": tmp, "deepseek": ROOT / "examples/deepseek_v2_tiny.py", "gpt_oss": ROOT / "examples/gpt_oss_tiny.py",
           "qwen3_5": ROOT / "examples/qwen3_5_tiny.py",
           "deepseek_v3": ROOT / "examples/deepseek_v3_671b.py"}
    data = env["data"] = tmp / "data"
    write_dataset(data, markov_docs(np.random.default_rng(0), 64, 60), vocab_size=64, eos_id=0)
    env["cfg"] = write_run_file(tmp / "tiny.py", data)
    for name, extra in RUN_FILES.items():
        env[name] = write_run_file(tmp / f"{name}.py", data, extra)

    def copy(src, name):
        env[name] = tmp / name
        shutil.copytree(src, env[name])
        return env[name]

    with open(copy(data, "data_truncated") / "tokens.bin", "r+b") as f:
        f.truncate(100)
    (copy(data, "data_bad_meta") / "meta.json").write_text("{not json")
    ids = np.memmap(copy(data, "data_bad_ids") / "tokens.bin", dtype=np.uint8, mode="r+")
    ids[::16] = 200  # inside uint8, outside the vocabulary of 64; meta.json unchanged
    ids.flush()
    del ids
    env["data_big_vocab"] = tmp / "data_big_vocab"
    write_dataset(env["data_big_vocab"], [list(range(200)) * 2], vocab_size=256, eos_id=0)

    config = load_run_config(env["cfg"])
    loop.train(config, tmp / "run_good", echo=False, stop_after=1)
    step = "checkpoints/step_00000001"
    (copy(tmp / "run_good", "run_bad") / step / ".metadata").write_bytes(b"garbage")
    (copy(tmp / "run_good", "run_badmeta") / step / "meta.json").write_text("{")
    with open(next((copy(tmp / "run_good", "run_nodata") / step).glob("*.distcp")), "r+b") as f:
        f.truncate(10)
    copy(tmp / "run_good", "run_full")
    env["run_ckfile"] = tmp / "run_ckfile"
    env["run_ckfile"].mkdir()
    (env["run_ckfile"] / "checkpoints").write_text("")
    env["dangling"] = tmp / "dangling"
    env["dangling"].symlink_to(tmp / "nowhere")

    model = config.model.build_model()
    model.init_weights(0)
    hf = env["hf"] = write_hf_dir(model, tmp / "hf")
    (copy(hf, "hf_junk") / "model.safetensors").write_bytes(b"not safetensors at all")
    weights = (hf / "model.safetensors").read_bytes()
    (copy(hf, "hf_trunc") / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (copy(hf, "hf_badjson") / "config.json").write_text("{")
    hf_config = json.loads((hf / "config.json").read_text())
    (copy(hf, "hf_badtype") / "config.json").write_text(json.dumps(dict(hf_config, hidden_size="32")))
    # a multimodal Qwen3.5-MoE config.json (text_config + vision_config) labelled as the text model
    (copy(hf, "hf_mm_as_text") / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5_moe_text", "text_config": {"hidden_size": 32}, "vision_config": {"depth": 2}}))
    (copy(hf, "hf_kimi_k25") / "config.json").write_text(json.dumps({"model_type": "kimi_k25"}))  # no text_config
    (copy(hf, "hf_llama") / "config.json").write_text(json.dumps(dict(hf_config, model_type="llama")))
    state = load_file(str(hf / "model.safetensors"))
    save_file(dict(state, **{"model.norm.weight": torch.ones(1)}), str(copy(hf, "hf_shape") / "model.safetensors"))
    index = {"weight_map": {k: "model-00002-of-00002.safetensors" if k == "model.norm.weight" else "model.safetensors" for k in state}}
    (copy(hf, "hf_shard") / "model.safetensors.index.json").write_text(json.dumps(index))

    rng = np.random.default_rng(1)
    for name, array in {"tokens": rng.integers(0, 64, (3, 12)), "tokens_1d": np.arange(5), "tokens_float": np.ones((2, 5)),
                        "tokens_big": np.full((2, 5), 64), "tokens_negative": -rng.integers(1, 64, (2, 5)), "tokens_none": np.zeros((0, 12), np.int64)}.items():
        env[name] = tmp / f"{name}.npy"
        np.save(env[name], array)
    env["data_npy"] = copy(data, "data_npy") / "eval.npy"  # the quickstart keeps its held-out array in its dataset directory
    np.save(env["data_npy"], rng.integers(0, 64, (3, 12)))
    env["empty_npy"] = tmp / "empty.npy"
    env["empty_npy"].write_bytes(b"")
    (tmp / "run.toml").write_text('[model]\nname = "llama3"\n')  # torchtitan's form
    env["notes"] = tmp / "notes.txt"
    env["notes"].write_text("not a tokenizer, not an array, not a directory\n")
    env["corpus"] = tmp / "corpus.txt"
    env["corpus"].write_text(" ".join(["alpha beta gamma delta"] * 200))
    env["jsonl"] = tmp / "bad.jsonl"
    env["jsonl"].write_text('{"body": "no text field"}\n')
    env["json_strings"] = tmp / "strings.json"
    env["json_strings"].write_text('["a JSON array of texts, not of records"]')
    env["empty_dir"] = tmp / "empty_dir"
    env["empty_dir"].mkdir()
    return env


def command(env: dict, case_id: str, line: str) -> list[str]:
    args = shlex.split(line.format(**{k: shlex.quote(str(v)) for k, v in env.items()}))
    if args[:1] == ["train"] and "--out" not in args:  # never write into the working directory
        args += ["--out", str(env["tmp"] / "runs" / case_id)]
    return args


def run_case(env: dict, case_id: str, line: str) -> tuple[int, str]:
    """Run one case in-process through cli.main; (exit code, stderr)."""
    err = io.StringIO()
    with PATCHES.get(case_id, nullcontext)(), redirect_stdout(io.StringIO()), redirect_stderr(err):
        try:
            main(command(env, case_id, line))
        except SystemExit as e:
            return e.code, err.getvalue()
    raise AssertionError("cli.main returned without exiting")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return make_env(tmp_path_factory.mktemp("errors"))


@pytest.mark.fast
@pytest.mark.parametrize("case_id, line, names", CASES, ids=[c[0] for c in CASES])
def test_bad_input_ends_in_one_line(env, case_id, line, names):
    if "cuda" in case_id and torch.cuda.is_available():
        pytest.skip("this case is train.device=cuda on a machine without CUDA")
    code, err = run_case(env, case_id, line)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], err
    if line.startswith("train") and "--out" not in line:  # a run that failed to start leaves no directory
        assert not (env["tmp"] / "runs" / case_id).exists(), list((env["tmp"] / "runs" / case_id).iterdir())
    if case_id == "disk-full":  # the partial save is removed and the last good checkpoint is named
        assert "No space left on device" in err and "step_00000001" in err
        assert [p.name for p in (env["run_full"] / "checkpoints").iterdir()] == ["step_00000001"]


@pytest.mark.fast
def test_ranks_whose_run_file_gives_other_configs_are_refused(env, monkeypatch):
    """A run file with `CONFIG.data.seed = random.randint(...)`: each rank loads its own; trained silently before."""
    from pithtrain.cli import check_same_config
    from pithtrain.config import ConfigError, load_run_config, run_dict

    config = load_run_config(str(env["cfg"]))
    other = run_dict(config)
    other["data"]["seed"] += 1
    monkeypatch.setattr(torch.distributed, "all_gather_object", lambda out, mine: out.__setitem__(slice(None), [mine, other]))
    with pytest.raises(ConfigError, match=r"configs differ in data\.seed;"):
        check_same_config(config, 2)


def test_a_config_error_is_printed_once_a_node(env, monkeypatch):
    """Under torchrun every rank meets the same config error: only each node's local rank 0 prints it. An error of
    the rank itself (an unwritable --out) is still printed by every rank."""
    lines = dict((c[0], c[1]) for c in CASES)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert run_case(env, "ep-zero", lines["ep-zero"]) == (2, "")
    code, err = run_case(env, "out-empty", lines["out-empty"])
    assert code == 2 and err.startswith("error: --out is empty"), err
    monkeypatch.setenv("LOCAL_RANK", "0")
    code, err = run_case(env, "ep-zero", lines["ep-zero"])
    assert code == 2 and err.startswith("error: parallel.ep"), err


def test_end_to_end_exit_code_and_debug_traceback(env):
    lines = dict((c[0], c[1]) for c in CASES)
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for case_id in END_TO_END:
        args = [sys.executable, "-m", "pithtrain", *command(env, case_id, lines[case_id])]
        result = subprocess.run(args, capture_output=True, text=True, env=base)
        assert result.returncode == 2, (case_id, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    result = subprocess.run(args, capture_output=True, text=True, env=dict(base, PITHTRAIN_DEBUG="1"))
    assert result.returncode != 0 and "Traceback" in result.stderr


# ---- tokenize, convert, eval and plot: inputs that are not what they seem, and what an overwrite keeps ----

TOOL_CASES = [  # (id, command line, what the one line must name)
    ("convert-src-missing", "convert {tmp}/nowhere {tools}/c", "nowhere does not exist"),
    ("convert-src-empty", "convert {empty_dir} {tools}/c", "empty_dir is neither an HF directory"),
    ("convert-src-file", "convert {notes} {tools}/c", "notes.txt is a file"),
    ("convert-src-dataset", "convert {data} {tools}/c", "data is a token dataset of `pithtrain tokenize`, not a model"),
    ("convert-src-no-config", "convert {hf_noconfig} {tools}/c", "lacks the config.json"),
    ("convert-src-no-weights", "convert {hf_noweights} {tools}/c", "lacks the *.safetensors"),
    ("convert-src-no-meta", "convert {run_nometa} {tools}/c", "pass a checkpoint or run directory with an intact one"),
    ("convert-dst-under-file", "convert {hf} {notes}/sub", "notes.txt/sub is a file, or lies under one"),
    ("convert-dst-symlink", "convert {hf} {dst_link} --overwrite", "dst_link is a symbolic link"),
    ("convert-dst-others", "convert {hf} {tools}", "(--overwrite replaces only an HF export or a checkpoint)"),
    ("convert-no-tokenizer-from-hf", "convert {hf} {tools}/c --no-tokenizer", "drop --no-tokenizer (it is for exports to HF)"),
    ("convert-tmp-users", "convert {hf} {tools}/mine --overwrite", "mine.tmp, where DST is written first, holds files convert "
     "does not write (notes.txt)"),
    ("convert-tmp-left", "convert {hf} {tools}/left", "left.tmp, where DST is written first, exists and is not empty; choose a new "
     "DST, or remove it or pass --overwrite (an interrupted convert left it"),
    ("eval-tokens-objects", "eval {hf} --tokens {tokens_objects}", "(an array of Python objects)"),
    ("eval-tokens-npz", "eval {hf} --tokens {tokens_npz}", "(an .npz archive of ids, more; save one array with np.save)"),
    ("eval-tokens-too-long", "eval {hf} --tokens {tokens_long}", "more than the model's max_position_embeddings="),
    ("eval-offsets-damaged", "eval {hf} --tokens {data_bad_offsets}", "doc_offsets.npy is damaged: not an .npy array"),
    ("eval-meta-not-int", "eval {hf} --tokens {data_meta_str}", "meta.json: num_tokens='lots' is not an integer"),
    ("eval-hf-more-layers", "eval {hf_fewer} --tokens {tokens}", "past the config's"),
    ("convert-over-training-checkpoint", "convert {hf} {run_over}/checkpoints/step_00000001 --overwrite",
     "step_00000001 is a training checkpoint (with its optimizer state)"),
    ("convert-tokenizer-broken", "convert {run_tok} {tools}/c", "data_tok_a/tokenizer.json is not a tokenizer ("),
    ("convert-config-list", "convert {hf_list} {tools}/c", "config.json holds a JSON list"),
    ("eval-config-list", "eval {hf_list} --tokens {tokens}", "config.json holds a JSON list"),
    ("eval-config-type", "eval {hf_four} --tokens {tokens}", "num_hidden_layers='four' (str): expected int; fix config.json"),
    ("eval-seq-len-too-long", "eval {hf} --tokens {data} --seq-len 100000", "max_position_embeddings"),
    ("convert-tensor-missing", "convert {hf_short} {tools}/c", "hf_short: HF checkpoint is missing model."),
    ("eval-max-tokens-zero", "eval {hf} --tokens {data} --max-tokens 0", "--max-tokens 0: must be at least 2"),
    ("eval-uint64-id", "eval {hf} --tokens {tokens_u64}", f"token id {2**63 + 5} is outside"),
    ("eval-other-tokenizer-hf", "eval {hf_tok} --tokens {data_tok_b}", "hf_tok/tokenizer.json (their SHA-256 differ)"),
    ("eval-other-tokenizer-run", "eval {run_tok} --tokens {data_tok_b}", "data_tok_a/tokenizer.json (their SHA-256 differ)"),
    ("tokenize-tokenizer-dir", "tokenize {corpus} --tokenizer {empty_dir} --out {tools}/t", "is a directory"),
    ("tokenize-no-text", "tokenize {empty_dir} --train-tokenizer --out {tools}/t", "no text in"),
    ("tokenize-own-meta", "tokenize {corpus} --train-tokenizer --out {own_meta} --overwrite", "(meta.json)"),
    ("tokenize-own-tokenizer", "tokenize {corpus} --train-tokenizer --out {own_tokenizer} --overwrite", "(tokenizer.json)"),
    ("tokenize-out-under-file", "tokenize {corpus} --train-tokenizer --out {notes}/sub", "is not a writable directory"),
    ("tokenize-jsonl-before-bpe", "tokenize {jsonl} --train-tokenizer --out {tools}/t", "bad.jsonl"),
    ("plot-missing", "plot {tmp}/nowhere", "nowhere: does not exist"),
    ("plot-loss-text", "plot {metrics_text}", "line 2: loss='high' is not a number"),
    ("plot-loss-dict", "plot {metrics_dict}", "line 1: loss={'a': 1} is not a number"),
    ("plot-bad-line-4", "plot {metrics_line4}", "line 4 is not JSON"),
    ("plot-out-format", "plot {tmp}/run_good --out {tools}/x.txt", "--out"),
    ("plot-out-users-file", "plot {tmp}/run_good --out {user_png}", "user.png exists and is not an image an earlier plot"),
]

TOOL_PATCHES = {"tokenize-jsonl-before-bpe": lambda: mock.patch("pithtrain.tools.tokenize.train_bpe",
                                                                side_effect=AssertionError("BPE ran before the input was read"))}


@pytest.fixture(scope="module")
def tool_env(env):
    """The battery's files, and: HF directories lacking a file or with a bad config.json, a run whose checkpoints
    lack meta.json, a model whose tokenizer is known (an HF export's tokenizer.json, a run's recorded SHA-256) and
    datasets of it and of another, the user's own meta.json and tokenizer.json, metrics files with bad values."""
    from pithtrain.train import checkpoint as ckpt
    from pithtrain.train.data import TokenDataset, write_dataset
    from safetensors.torch import load_file, save_file

    out, tools = dict(env), env["tmp"] / "tools"
    tools.mkdir()
    out["tools"] = tools

    def copy(src, name):
        out[name] = shutil.copytree(src, tools / name)
        return out[name]

    config = json.loads((env["hf"] / "config.json").read_text())
    for name, content in (("hf_list", [1, 2]), ("hf_four", dict(config, num_hidden_layers="four"))):
        (copy(env["hf"], name) / "config.json").write_text(json.dumps(content))
    (copy(env["hf"], "hf_noconfig") / "config.json").unlink()
    (copy(env["hf"], "hf_noweights") / "model.safetensors").unlink()
    weights = load_file(env["hf"] / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != max(weights)}, copy(env["hf"], "hf_short") / "model.safetensors")
    for meta in copy(env["tmp"] / "run_good", "run_nometa").glob("checkpoints/*/meta.json"):
        meta.unlink()
    out["dst_link"] = tools / "dst_link"
    out["dst_link"].symlink_to(env["empty_dir"])
    for name in ("tok_a", "tok_b"):
        (tools / f"{name}.json").write_text(json.dumps({"stand-in": name}))
        out[f"data_{name}"] = tools / f"data_{name}"
        write_dataset(out[f"data_{name}"], markov_docs(np.random.default_rng(4), 64, 40), vocab_size=64, eos_id=0,
                      tokenizer_file=str(tools / f"{name}.json"))
    shutil.copyfile(tools / "tok_a.json", copy(env["hf"], "hf_tok") / "tokenizer.json")
    meta_file = next(copy(env["tmp"] / "run_good", "run_tok").glob("checkpoints/*/meta.json"))
    meta = json.loads(meta_file.read_text())
    meta.pop("meta_crc32")
    meta["dataset"] = TokenDataset(out["data_tok_a"]).identity  # as if the run had trained on data_tok_a
    meta_file.write_text(json.dumps(dict(meta, meta_crc32=ckpt._json_crc(meta))))
    out["tokens_u64"] = tools / "tokens_u64.npy"
    np.save(out["tokens_u64"], np.array([[1, 2, 2**63 + 5]], dtype=np.uint64))
    copy(env["tmp"] / "run_good", "run_over")
    out["user_png"] = tools / "user.png"
    out["user_png"].write_bytes(b"\x89PNG\r\n\x1a\n a photo, not a plot")
    out["tokens_long"] = tools / "tokens_long.npy"
    np.save(out["tokens_long"], np.ones((1, config["max_position_embeddings"] + 2), np.int64))
    (copy(out["data_tok_a"], "data_bad_offsets") / "doc_offsets.npy").write_text("garbage")
    meta = json.loads((copy(out["data_tok_a"], "data_meta_str") / "meta.json").read_text())
    (tools / "data_meta_str" / "meta.json").write_text(json.dumps(dict(meta, num_tokens="lots")))
    fewer = dict(config, num_hidden_layers=config["num_hidden_layers"] - 1)  # weights of one layer more
    (copy(env["hf"], "hf_fewer") / "config.json").write_text(json.dumps(fewer))
    out["tokens_objects"] = tools / "tokens_objects.npy"
    np.save(out["tokens_objects"], np.array([[1, "a"]], dtype=object), allow_pickle=True)
    out["tokens_npz"] = tools / "tokens.npz"
    np.savez(out["tokens_npz"], ids=np.ones((2, 5), np.int64), more=np.ones(3))
    for name, file, content in (("own_meta", "meta.json", '{"my": "settings"}'), ("own_tokenizer", "tokenizer.json", "{}"),
                                ("mine.tmp", "notes.txt", "mine"), ("left.tmp", "model.safetensors", "half")):
        (tools / name).mkdir()
        (tools / name / file).write_text(content)
        out[name] = tools / name
    for name, text in (("metrics_text", '{"step": 1, "loss": 4.0}\n{"step": 2, "loss": "high"}\n'),
                       ("metrics_dict", '{"step": 1, "loss": {"a": 1}}\n'),
                       ("metrics_line4", '{"step": 1}\n{"step": 2}\n\n{\n{"step": 5}\n')):
        out[name] = tools / f"{name}.jsonl"
        out[name].write_text(text)
    return out


@pytest.mark.fast
@pytest.mark.parametrize("case_id, line, names", TOOL_CASES, ids=[c[0] for c in TOOL_CASES])
def test_tool_case_ends_in_one_line(tool_env, case_id, line, names):
    with TOOL_PATCHES.get(case_id, nullcontext)():
        code, err = run_case(tool_env, case_id, line)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], err
    assert "free space" not in err and not (tool_env["tools"] / "c").exists() and not (tool_env["tools"] / "t").exists()
    if case_id.startswith("tokenize-own-"):  # the user's file is kept as it was
        own = tool_env[case_id.removeprefix("tokenize-").replace("-", "_")]
        assert [p.name for p in own.iterdir()] == [names.strip("()")]
    assert (tool_env["own_meta"] / "meta.json").read_text() == '{"my": "settings"}' and (tool_env["mine.tmp"] / "notes.txt").is_file()


@pytest.mark.fast
def test_convert_overwrite_keeps_the_old_output_when_a_rename_fails(tool_env, monkeypatch):
    """convert --overwrite moves the old DST aside, renames the new one in, then deletes the old: a rename that fails
    (DST a mount point: EBUSY) leaves the old DST as it was, in both directions, and no temporary directory. A DST
    the shell stands in (`.`) is refused, not moved away."""
    tools = tool_env["tools"]
    for src, dst in ((tool_env["hf"], tools / "ow_ck"), (tool_env["tmp"] / "run_good", tools / "ow_hf")):
        assert run_case(tool_env, "ow", f"convert {src} {dst}")[0] == 0
        (dst / "model-00009-of-00009.safetensors").write_text("the old DST")  # a stale shard: replaced
        before = {p.name: p.read_bytes() for p in dst.iterdir()}
        rename = os.rename
        for failing in (dst, dst.with_name(dst.name + ".tmp")):  # moving the old aside, or renaming the new in

            def flaky(a, b, *args, **kwargs):
                if Path(a) == failing:
                    raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(a))
                return rename(a, b, *args, **kwargs)

            with mock.patch("os.rename", flaky):
                code, err = run_case(tool_env, "ow", f"convert {src} {dst} --overwrite")
            error = err.strip().splitlines()[-1]  # after the run's note that its dataset has no tokenizer
            assert code == 2 and error.startswith("error: ") and f"{dst}" in error and "note" not in error, err
            assert {p.name: p.read_bytes() for p in dst.iterdir()} == before
            assert [p.name for p in tools.iterdir() if dst.name in p.name] == [dst.name]
        assert run_case(tool_env, "ow", f"convert {src} {dst} --overwrite")[0] == 0
        assert not (dst / "model-00009-of-00009.safetensors").exists() and [p.name for p in tools.iterdir() if dst.name in p.name] == [dst.name]
        before, inode = {p.name: p.read_bytes() for p in dst.iterdir()}, dst.stat().st_ino
        monkeypatch.chdir(dst)
        code, err = run_case(tool_env, "ow", f"convert {src} . --overwrite")
        assert code == 2 and "current directory" in err.strip().splitlines()[-1] and os.getcwd() == str(dst), err
        assert os.stat(".").st_ino == inode and {p.name: p.read_bytes() for p in dst.iterdir()} == before
        assert [p.name for p in tools.iterdir() if dst.name in p.name] == [dst.name]
        monkeypatch.chdir(tool_env["tmp"])


@pytest.mark.fast
def test_convert_stopped_by_ctrl_c_leaves_no_partial_output(tool_env):
    """Ctrl-C while convert writes (either direction) ends in one line and the shell's 130, removes DST.tmp (which would
    refuse the rerun), and the same command then succeeds."""
    from pithtrain.tools import hf
    from pithtrain.train import checkpoint as ckpt

    for src, dst, writer in ((tool_env["hf"], "ki_ck", (ckpt.dcp, "save")), (tool_env["tmp"] / "run_good", "ki_hf", (hf, "save_file"))):
        def partial_then_ctrl_c(*args, **kwargs):
            (tool_env["tools"] / f"{dst}.tmp" / "half-written").write_text("")
            raise KeyboardInterrupt

        line = f"convert {src} {tool_env['tools'] / dst}"
        with mock.patch.object(*writer, partial_then_ctrl_c):
            code, err = run_case(tool_env, "ki", line)
        assert code == 130 and err.strip().splitlines()[-1] == "stopped by SIGINT (Ctrl-C)", err
        assert [p.name for p in tool_env["tools"].iterdir() if dst in p.name] == []
        assert run_case(tool_env, "ki", line)[0] == 0
    # Ctrl-C while the commands' imports run: torch's C++ import of numpy catches the KeyboardInterrupt (and leaves numpy
    # half-imported), so it must be held until they are done, not lost: the run would go on, or end in a traceback
    from pithtrain import cli

    def swallowing_import(build=cli.build_parser):
        with contextlib.suppress(KeyboardInterrupt):
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # as a terminal's to the CLI's one thread
            time.sleep(0.01)
        return build()

    with mock.patch.object(cli, "build_parser", swallowing_import):
        code, err = run_case(tool_env, "ki", "train --help")
    assert code == 130 and err.strip().splitlines() == ["stopped by SIGINT (Ctrl-C)"], err


@pytest.mark.fast
def test_eval_names_a_dataset_tokenized_again_in_place(tool_env):
    from pithtrain.config import UserError
    from pithtrain.tools import hf

    data = tool_env["data_tok_a"]  # the run recorded another SHA-256 for this very tokenizer.json
    with pytest.raises(UserError, match=r"data_tok_a/tokenizer.json is no longer the tokenizer the model trained with .* re-tokenized"):
        hf.load_tokens(data, 100, 16, tokenizer=("0" * 64, str(Path(data) / "tokenizer.json")))


def test_eval_rows_and_config_kept_through_convert(tool_env, monkeypatch, capsys):
    """An HF directory's seq_length and pad_token_id survive HF -> checkpoint -> HF, so eval of the checkpoint uses the
    rows eval of the HF directory uses; the row length's real source is said; a bad seq_length names config.json.
    convert to "." works; the round trip's missing tokenizer is said in words that fit."""
    from cli_util import cli

    tools = tool_env["tools"]
    hf = shutil.copytree(tool_env["hf"], tools / "hf_rows")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(config, seq_length=16, pad_token_id=0)))
    cli(["convert", hf, tools / "ck_rows"], capsys)
    back = tools / "hf_back"
    back.mkdir()
    monkeypatch.chdir(back)
    _, err = cli(["convert", tools / "ck_rows", "."], capsys)
    assert f"ck_rows was converted from {hf}" in err and Path("config.json").is_file()  # filled, not replaced: "." still is it
    for folder in (tools / "ck_rows", back):
        assert {k: json.loads((folder / "config.json").read_text()).get(k) for k in ("seq_length", "pad_token_id")} == \
            {"seq_length": 16, "pad_token_id": 0}
    results = [json.loads(cli(["eval", m, "--tokens", tool_env["data"], "--max-tokens", "100", "--json", "--device", "auto"], capsys)[0])
               for m in (hf, tools / "ck_rows", back)]
    assert results[0]["seq_len"] == 16 and results[1] == results[0] == results[2]
    out, _ = cli(["eval", tools / "ck_rows", "--tokens", tool_env["data"], "--max-tokens", "10"], capsys)
    assert "rows of 9 predicted tokens (all 10 tokens taken, fewer than the 16 + 1 of seq_length of" in out
    for value in (0, -5, 1, True, "16", 10**6):
        (hf / "config.json").write_text(json.dumps(dict(config, seq_length=value)))
        _, err = cli(["eval", hf, "--tokens", tool_env["data"]], capsys, code=2)
        assert err.startswith(f"error: rows of {value!r} tokens (seq_length of {hf / 'config.json'})") and err.count("\n") == 1, err
    out, _ = cli(["eval", hf, "--tokens", tool_env["data"], "--seq-len", "8", "--max-tokens", "16"], capsys)  # no seq_length read
    assert "rows of 8 predicted tokens (--seq-len)" in out


@pytest.mark.fast
def test_plot_out_without_a_suffix_names_the_file_written(tool_env, capsys):
    from cli_util import cli

    out, _ = cli(["plot", tool_env["tmp"] / "run_good", "--out", tool_env["tools"] / "noext"], capsys)
    assert out == f"wrote {tool_env['tools'] / 'noext.png'}\n" and (tool_env["tools"] / "noext.png").read_bytes()[:4] == b"\x89PNG"


# ---- options that cannot take effect, datasets that are not what they claim, the newer commands ----

TRUST_CASES = [  # (id, command line, what the one line must name)
    ("fp8-emulate-without-fp8", "train {cfg} --set train.fp8_emulate=true", "train.fp8_emulate=true has no effect with train.fp8=off"),
    ("muon-all-excluded", "train {cfg} --set optim.name=muon --set 'optim.muon_exclude=[\"*\"]'", "excludes every weight matrix"),
    ("muon-all-excluded-dry-run", "train {cfg} --dry-run --set optim.name=muon --set 'optim.muon_exclude=[\"layers.*\",\"embed_tokens.*\",\"lm_head.*\"]'",
     "optim.muon_exclude"),
    ("profile-step-past-end", "train {cfg} --set train.profile_step=3", "train.profile_step=3: there is no such step"),
    ("profile-step-negative", "train {cfg} --set train.profile_step=-1", "train.profile_step=-1"),
    ("profile-step-before-resume", "train {cfg} --out {run_profile} --set train.profile_step=1", "resumes after step 1"),
    ("timeout-huge", "train {cfg} --set parallel.timeout_s=1e300", "parallel.timeout_s"),
    ("eval-path-is-data-path", "train {cfg} --set train.eval_every=1 --set data.eval_path={data}", "data.eval_on_train=true"),
    ("eval-path-copy-of-data", "train {cfg} --set train.eval_every=1 --set data.eval_path={data_copy}", "is a training dataset"),
    ("eval-path-in-blend", "train {cfg} --set 'data.path=[1,\"{data_tok}\",1,\"{data_tok_2}\"]' --set train.eval_every=1 "
     "--set data.eval_path={data_tok_2}", "is a training dataset"),
    ("eval-path-blend-other-tokenizer", "train {cfg} --set 'data.path=[1,\"{data_tok}\",1,\"{data_tok_2}\"]' --set "
     "train.eval_every=1 --set data.eval_path={data_tok_other}", "tokenize it with --tokenizer"),
    ("eval-path-other-tokenizer", "train {cfg} --set data.path={data_tok} --set train.eval_every=1 --set data.eval_path={data_tok_other}",
     "another tokenizer"),
    ("wandb-no-credentials", "train {cfg} --set train.wandb_project=moe", "WANDB_MODE=offline"),
    ("wandb-no-network", "train {cfg} --set train.wandb_project=moe", "wandb did not start"),
    ("dry-run-held-run-dir", "train {cfg} --dry-run --out {run_held}", "is in use by pid"),
    ("resume-meta-step-edited", "train {cfg} --out {run_meta_edited}", "CRC32"),
    ("disk-full-runtime-error", "train {cfg} --out {run_full_rt}", "write failed"),
    ("disk-read-only-runtime-error", "train {cfg} --out {run_rofs}", "EROFS"),
    ("plot-rows-without-step", "plot {metrics_nostep}", 'line 2 has no integer "step"'),
    ("plot-empty-metrics", "plot {metrics_empty}", "no metrics rows"),
    ("plot-out-directory", "plot {tmp}/run_good --out {empty_dir}", "is a directory"),
]


def _without_wandb_credentials():
    """No WANDB_API_KEY, no WANDB_MODE, an empty netrc: what a machine never logged in has."""
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL")}
    env["NETRC"] = os.devnull
    return mock.patch.dict(os.environ, env, clear=True)


class _OfflineWandb(types.ModuleType):
    """wandb with a key but no network: init fails as the real one does (a CommError after retries)."""

    def __init__(self):
        super().__init__("wandb")

    def init(self, **kwargs):
        raise ConnectionError("Network error (ConnectionError), entering retry loop: api.wandb.ai unreachable")


@contextmanager
def _wandb_without_network():
    with mock.patch.dict(os.environ, {"WANDB_API_KEY": "0" * 40, "WANDB_MODE": "online"}), \
            mock.patch.dict(sys.modules, {"wandb": _OfflineWandb()}):
        yield


@contextmanager
def _held(run):
    from pithtrain.train.rundir import RunLock

    lock = RunLock(run)
    try:
        yield
    finally:
        lock.release()


def _failing_write(error):
    return mock.patch("torch.distributed.checkpoint.filesystem._write_item", side_effect=error)


def _runtime_error_from(code):
    """PyTorch's writers report an OS error as a RuntimeError (the OSError as its cause)."""
    error = RuntimeError("PytorchStreamWriter failed writing file")
    error.__cause__ = OSError(code, os.strerror(code))
    return error


TRUST_PATCHES = {
    "wandb-no-credentials": _without_wandb_credentials,
    "wandb-no-network": _wandb_without_network,
    "dry-run-held-run-dir": lambda env: _held(env["run_held"]),
    "disk-full-runtime-error": lambda: _failing_write(RuntimeError(
        "[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file data/0: file write failed")),
    "disk-read-only-runtime-error": lambda: _failing_write(_runtime_error_from(errno.EROFS)),
}


@pytest.fixture(scope="module")
def trust_env(env):
    """The battery's files, and: datasets with two different tokenizer.json files, a copy of the training
    data, runs to hold, damage or fill, metrics files without steps."""
    from pithtrain.train.data import write_dataset

    tmp = env["tmp"]
    out = dict(env)
    for name, tokenizer in (("data_tok", "tokenizer A"), ("data_tok_other", "tokenizer B"), ("data_tok_2", "tokenizer A")):
        (tmp / f"{name}.json").write_text(json.dumps({"stand-in": tokenizer}))
        out[name] = tmp / name
        write_dataset(out[name], markov_docs(np.random.default_rng(len(name)), 64, 80), vocab_size=64, eos_id=0,
                      tokenizer_file=str(tmp / f"{name}.json"))
    out["data_copy"] = shutil.copytree(env["data"], tmp / "data_copy")
    for name in ("run_held", "run_meta_edited", "run_full_rt", "run_rofs", "run_profile"):
        out[name] = shutil.copytree(tmp / "run_good", tmp / name)
    meta = out["run_meta_edited"] / "checkpoints/step_00000001/meta.json"
    text = meta.read_text()
    assert text.count('"step": 1,') == 1
    meta.write_text(text.replace('"step": 1,', '"step": 2,'))  # same size: only its own checksum tells
    out["metrics_nostep"] = tmp / "nostep.jsonl"
    out["metrics_nostep"].write_text('{"step": 1, "loss": 4.0}\n{"loss": 3.0}\n')
    out["metrics_empty"] = tmp / "empty.jsonl"
    out["metrics_empty"].write_text("")
    return out


@pytest.mark.fast
@pytest.mark.parametrize("case_id, line, names", TRUST_CASES, ids=[c[0] for c in TRUST_CASES])
def test_trust_case_ends_in_one_line(trust_env, case_id, line, names):
    patch = TRUST_PATCHES.get(case_id, lambda: nullcontext())
    context = patch(trust_env) if patch.__code__.co_argcount else patch()
    err = io.StringIO()
    with context, redirect_stdout(io.StringIO()), redirect_stderr(err):
        with pytest.raises(SystemExit) as exit_info:
            main(command(trust_env, case_id, line))
    lines = err.getvalue().strip().splitlines()
    print(f"{case_id}: {err.getvalue().strip()}")  # the message each case gets (pytest -rP shows it)
    assert exit_info.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], err.getvalue()
    if line.startswith("train") and "--out" not in line:
        assert not (trust_env["tmp"] / "runs" / case_id).exists()
    if case_id.startswith("disk-"):  # the partial save is removed; the last good checkpoint is named and kept
        run = trust_env[line.split("--out {")[1].rstrip("}")]
        assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000001"] and "step_00000001" in lines[0]
    if case_id == "plot-out-directory":
        assert list(trust_env["empty_dir"].iterdir()) == []


def test_a_rank_whose_peers_never_come(env):
    """One rank of two started by hand: its rendezvous fails in one line after parallel.timeout_s, and a
    SIGTERM while it waits ends it at once (a blocking rendezvous runs no Python signal handler). A rank 1
    whose MASTER_PORT is another program's: one line too, without torch's C++ connection logs, whether that
    program closes the connection or never answers (then after twice parallel.timeout_s)."""
    import signal
    import socket
    import threading
    import time

    with socket.socket() as a, socket.socket() as b:  # two free ports: the two ranks 0 below overlap
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        ports = a.getsockname()[1], b.getsockname()[1]
    ranks = [dict(os.environ, PYTHONPATH=str(ROOT), RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
             for port in ports]
    args = [sys.executable, "-m", "pithtrain", "train", env["cfg"], "--ep", "2"]
    closes, silent = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: [closes.accept()[0].close() for _ in iter(int, 1)], daemon=True).start()
    # the closing program's rank fails by torch's own timeout before the guard's (twice it): 3 s of margin under load
    others = [subprocess.Popen([*args, "--out", env["tmp"] / f"other{i}", "--set", f"parallel.timeout_s={timeout}"],
                               env=dict(ranks[0], RANK="1", MASTER_PORT=str(server.getsockname()[1])),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for i, (server, timeout) in enumerate([(closes, 3), (silent, 1)])]
    alone = subprocess.Popen([*args, "--out", env["tmp"] / "alone", "--set", "parallel.timeout_s=2"], env=ranks[0],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert alone.stdout.readline().startswith("config:")  # the second one starts while this one waits for its peer
    waiting = subprocess.Popen([*args, "--out", env["tmp"] / "waits", "--set", "parallel.timeout_s=60"], env=ranks[1],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert waiting.stdout.readline().startswith("config:")
    time.sleep(2)  # into the rendezvous
    start = time.monotonic()
    waiting.send_signal(signal.SIGTERM)
    assert waiting.wait(timeout=30) == -signal.SIGTERM and time.monotonic() - start < 10
    _, err = alone.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert alone.returncode == 2 and len(lines) == 1 and "the rendezvous at 127.0.0.1" in lines[0], err
    for other, why in zip(others, ["failed (", "(no answer in 2 s: is MASTER_PORT another program's?)"]):
        _, err = other.communicate(timeout=60)
        assert other.returncode == 2 and len(err.strip().splitlines()) == 1 and why in err, err
    closes.close()
    silent.close()
