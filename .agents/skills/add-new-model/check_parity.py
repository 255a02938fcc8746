"""HF parity check for a model family; ends with PASS or FAIL.

    python .agents/skills/add-new-model/check_parity.py HF_DIR            # config.json + safetensors
    python .agents/skills/add-new-model/check_parity.py path/config.json  # random weights from a config

Checks, in fp32 on the CPU: (1) logits of PithTrain's staged forward and of `reference_forward`
against transformers (relative error <= 1e-5), with random tokens; (2) export with
`write_hf_dir` loads in transformers with no missing or unexpected keys and gives the same
logits; (3) import -> export -> import is exact.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def hf_load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager",
                                                experts_implementation="eager", output_loading_info=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="an HF directory, or a config.json to instantiate with random weights")
    parser.add_argument("--seq", type=int, default=17)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--std", type=float, default=0.2, help="random weights: std (large => non-trivial routing)")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    from pithtrain.parallel.expert import ExpertEngine, LocalDispatch
    from pithtrain.tools.hf import load_model, read_hf_state, write_hf_dir

    work = Path(tempfile.mkdtemp(prefix="parity-"))
    source = Path(args.source)
    if source.is_file():  # a bare config: random weights
        hf_cfg = AutoConfig.for_model(**json.loads(source.read_text()))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, args.std)
        model.save_pretrained(work / "hf")
        source = work / "hf"
    checks = []
    hf, _ = hf_load(source)
    ours = load_model(source)
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
    clean = not info["missing_keys"] and not info["unexpected_keys"]
    checks.append(("export loads in transformers", clean, f"missing {sorted(info['missing_keys'])[:3]} unexpected {sorted(info['unexpected_keys'])[:3]}"))
    with torch.no_grad():
        again_logits = exported.eval()(ids).logits
    checks.append(("exported logits", rel(again_logits, ref) <= 1e-5, f"rel {rel(again_logits, ref):.2e}"))
    original, roundtrip = read_hf_state(source), read_hf_state(work / "export")
    same = set(original) == set(roundtrip) and all(torch.equal(original[k].float(), roundtrip[k].float()) for k in original)
    checks.append(("import -> export is exact", same, f"{len(original)} tensors"))
    for name, ok, detail in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    passed = all(ok for _, ok, _ in checks)
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
