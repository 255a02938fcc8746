import sys; sys.path.insert(0, "tests")
import tempfile, os, sys; sys.path.insert(0,'tests')
import numpy as np
from conftest import tiny_config, write_dataset, markov_docs
from pithtrain.train import loop
from pithtrain.ops import grouped_gemm
d=tempfile.mkdtemp()+"/m"; write_dataset(d, markov_docs(np.random.default_rng(7), 64, 400), vocab_size=64, eos_id=0)
calls=[0]; orig=grouped_gemm._FP8HeadLinear.apply
def counted(*a): calls[0]+=1; return orig(*a)
grouped_gemm._FP8HeadLinear.apply=counted
c=tiny_config(d, steps=2); c.train.fp8, c.train.fp8_emulate, c.train.fp8_head="rowwise",True,True; c.train.device="cuda"; c.train.fp8_emulate=False
with tempfile.TemporaryDirectory() as t:
    loop.train(c, t+"/b", echo=False)
print("calls", calls)
