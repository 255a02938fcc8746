"""HF parity check for a model family; ends with PASS or FAIL.

    python .agents/skills/add-new-model/check_parity.py HF_DIR            # config.json + safetensors
    python .agents/skills/add-new-model/check_parity.py path/config.json  # random weights from a config

Checks, in fp32 on the CPU: (1) logits of PithTrain's staged forward and of `reference_forward`
against transformers (relative error <= 1e-5), with random tokens; (2) export with
`write_hf_dir` loads in transformers with no missing or unexpected keys and gives the same
logits; (3) import -> export -> import is exact. Before anything is built, the config must be one
of pithtrain's families (pithtrain.models.config_from_hf), valid, and small enough for this
machine's memory. The HF copies go to --work (kept), else to a temporary directory removed at the end.
"""

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "_common"))
import runs  # noqa: E402  (the helpers the skill scripts share: JSON files, argument types, PASS/FAIL)

COPIES = 5  # fp32 copies of the weights alive at once: the HF model, ours, the export reloaded, two state dicts


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def hf_load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager",
                                                experts_implementation="eager", output_loading_info=True)


def read_source(source: Path) -> dict:
    """The HF config of SOURCE (a config.json, or an HF directory with weights), checked to be a family of
    pithtrain's, valid, and small enough to hold COPIES times here; BadInput naming the file otherwise."""
    from pithtrain.config import check_types
    from pithtrain.models import config_from_hf

    if not source.exists():
        raise runs.BadInput(f"{source}: no such file or directory (give an HF directory or a config.json)")
    path = source / "config.json" if source.is_dir() else source
    if source.is_dir() and not (path.is_file() and any(source.glob("*.safetensors"))):
        raise runs.BadInput(f"{source} is no HF directory (config.json and *.safetensors); give one, or a config.json")
    hf = runs.read_json(path)
    if not isinstance(hf, dict):
        raise runs.BadInput(f"{path} holds a JSON {type(hf).__name__}, not an HF config object")
    try:
        cfg = config_from_hf(hf)  # an unknown model_type: a ValueError naming the supported ones
        check_types(cfg, "model.")
        cfg.validate()
    except (TypeError, ValueError) as e:  # ConfigError is a ValueError
        raise runs.BadInput(f"{path}: {str(e).replace('the run file or --set', 'config.json')}") from None
    with torch.device("meta"):
        params = sum(p.numel() for p in cfg.build_model().parameters())
    need, have = COPIES * 4 * params, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > have:
        raise runs.BadInput(f"{path}: {params / 1e9:.2f}B parameters need about {need / 2**30:.0f} GiB here ({COPIES} fp32 "
                            f"copies), this machine has {have / 2**30:.0f} GiB; check a smaller config of the family")
    return hf


@runs.interruptible
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="an HF directory, or a config.json to instantiate with random weights")
    parser.add_argument("--seq", type=runs.number(int, low=2), default=17,  # one token: no mask, no relative position
                        help="tokens a row (at least 2: one checks neither the causal mask nor RoPE)")
    parser.add_argument("--batch", type=runs.COUNT, default=2)
    parser.add_argument("--std", type=runs.POSITIVE, default=0.2, help="random weights: std (large => non-trivial routing)")
    parser.add_argument("--work", type=runs.WORK_DIR, help="directory for the HF copies, kept (default: a temporary one, removed at the end)")
    args = parser.parse_args()
    try:
        hf_cfg = read_source(args.source)
    except runs.BadInput as e:
        return runs.verdict(False, str(e))
    if args.work and any((Path(args.work) / name).exists() for name in ("hf", "export")):
        return runs.verdict(False, f"--work {args.work} already holds hf/ or export/: pass a new directory")
    with runs.workdir(args.work, "parity-") as work:
        return check(args, hf_cfg, work)


def check(args, hf_cfg: dict, work: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    from pithtrain.config import UserError
    from pithtrain.parallel.expert import ExpertEngine, LocalDispatch
    from pithtrain.tools.hf import load_model, read_hf_state, write_hf_dir

    source = args.source
    if source.is_file():  # a bare config: random weights
        if hf_cfg.get("num_nextn_predict_layers"):  # transformers builds no MTP layer: the check covers the main model
            print(f"note: transformers has no multi-token prediction layer: the random copy has num_nextn_predict_layers "
                  f"{hf_cfg['num_nextn_predict_layers']} -> 0 (an HF directory with MTP weights checks them too)")
            hf_cfg = dict(hf_cfg, num_nextn_predict_layers=0)
        torch.manual_seed(0)
        try:  # transformers' own checks come as its own exception types: any of them is a FAIL naming the file
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_cfg), dtype=torch.float32)
        except Exception as e:
            return runs.verdict(False, f"{source}: transformers cannot build it ({type(e).__name__}: "
                                       f"{str(e).splitlines()[0][:200] if str(e) else ''})")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, args.std)
        model.save_pretrained(work / "hf")
        source = work / "hf"
    checks = []
    try:
        hf, _ = hf_load(source)
        ours = load_model(source)
    except UserError as e:
        return runs.verdict(False, (str(e) if str(source) in str(e) else f"{source}: {e}").splitlines()[0])
    except Exception as e:  # transformers' or safetensors' refusal of the weights (missing, damaged, another shape)
        return runs.verdict(False, f"{source}: loading it failed ({type(e).__name__}: {(str(e) or '?').splitlines()[0][:200]})")
    ids = torch.randint(0, ours.cfg.vocab_size, (args.batch, args.seq))
    pos = torch.arange(args.seq).expand(args.batch, args.seq)
    with torch.no_grad():
        ref = hf.eval()(ids).logits
        staged = ours.eval()(ids, pos, ExpertEngine(LocalDispatch()))
    checks.append(("staged forward vs transformers", rel(staged, ref) <= 1e-5, f"rel {rel(staged, ref):.2e}"))
    oracle = ours.reference_forward(ids)
    checks.append(("reference_forward vs transformers", rel(oracle, ref) <= 1e-5, f"rel {rel(oracle, ref):.2e}"))
    write_hf_dir(ours, work / "export")
    exported, info = hf_load(work / "export")
    n, depth = ours.cfg.num_hidden_layers, getattr(ours.cfg, "num_nextn_predict_layers", 0)  # transformers has no MTP layer:
    mtp = tuple(f"model.layers.{n + d}." for d in range(depth))  # its weights, unexpected there, are checked by the round trip
    unexpected = sorted(k for k in info["unexpected_keys"] if not k.startswith(mtp))
    clean = not info["missing_keys"] and not unexpected
    checks.append(("export loads in transformers", clean, f"missing {sorted(info['missing_keys'])[:3]} unexpected {unexpected[:3]}"
                   + (f" (not counted: {', '.join(mtp)}*, MTP weights transformers builds no layer for)" if mtp else "")))
    with torch.no_grad():
        again_logits = exported.eval()(ids).logits
    checks.append(("exported logits", rel(again_logits, ref) <= 1e-5, f"rel {rel(again_logits, ref):.2e}"))
    original, roundtrip = read_hf_state(source), read_hf_state(work / "export")
    original = {k.replace("model.language_model.", "model.", 1): v for k, v in original.items()  # what converts: a
                if not k.startswith(("model.visual.", "mtp."))}  # multimodal one's language model, no Qwen3.5 MTP
    same = set(original) == set(roundtrip) and all(torch.equal(original[k].float(), roundtrip[k].float()) for k in original)
    checks.append(("import -> export is exact", same, f"{len(original)} tensors"))
    for name, ok, detail in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    failed = [f"{name} ({detail})" for name, ok, detail in checks if not ok]
    return runs.verdict(not failed, "; ".join(failed) or f"{len(checks)} checks")


if __name__ == "__main__":
    sys.exit(main())
