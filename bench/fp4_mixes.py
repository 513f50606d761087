"""Which FP4 + 8-bit layer mixes vLLM loads (issue 40: the ground under a future FP4 ``--target-bits``).

    python bench/fp4_mixes.py make OUT                  # with llm-compressor: one checkpoint per mix of the reference
                                                        # model, its MLPs in FP4 and its attention in another scheme
    VLLM_PYTHON bench/fp4_mixes.py load OUT RESULTS     # in vLLM's Python: each one loaded in its own process, a few
                                                        # tokens generated; RESULTS/NAME.log and a table on stdout

Round-to-nearest throughout (this asks what loads, not how well); the NVFP4 W4A4 mix calibrates its activation
global scales on a few repeated sentences. The MLP and attention split mirrors how a bits target would mix: vLLM
fuses q/k/v and gate/up, so a mix must give each fused group one scheme.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SOURCE = "models/quantkit-tiny"
ATTENTION = ["re:.*self_attn\\.(q|k|v|o)_proj$"]
MLP = ["re:.*mlp\\.(gate|up|down)_proj$"]
# name -> llm-compressor preset -> targets
MIXES = {
    "nvfp4-fp8dyn": {"NVFP4A16": MLP, "FP8_DYNAMIC": ATTENTION},
    "nvfp4-w8a16": {"NVFP4A16": MLP, "W8A16": ATTENTION},
    "nvfp4-fp8block": {"NVFP4A16": MLP, "FP8_BLOCK": ATTENTION},
    "mxfp4-fp8dyn": {"MXFP4A16": MLP, "FP8_DYNAMIC": ATTENTION},
    "mxfp4-w8a16": {"MXFP4A16": MLP, "W8A16": ATTENTION},
    "nvfp4-mxfp4": {"NVFP4A16": MLP, "MXFP4A16": ATTENTION},
    "nvfp4w4a4-fp8dyn": {"NVFP4": MLP, "FP8_DYNAMIC": ATTENTION},
}
LOAD = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], enforce_eager=True, gpu_memory_utilization=float(sys.argv[2]), max_model_len=512)
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
print("RESULT loaded, generated:", repr(out[0].outputs[0].text))
"""


def make(out: Path) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SOURCE)
    for name, scheme in MIXES.items():
        model = AutoModelForCausalLM.from_pretrained(SOURCE, dtype=torch.bfloat16)
        data = {}
        if "w4a4" in name:
            ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 40)["input_ids"][:256]
            data = {"dataset": Dataset.from_dict({"input_ids": [ids] * 4}), "num_calibration_samples": 4,
                    "max_seq_length": 256}
        oneshot(model=model, recipe=QuantizationModifier(scheme=scheme, ignore=["lm_head"]), **data)
        model.save_pretrained(out / name, save_compressed=True)
        tokenizer.save_pretrained(out / name)
        print(name, "made")


def load(folder: Path, results: Path, memory: float = 0.2) -> None:
    """One vLLM process per checkpoint, one after another (a shared GPU's memory profiling fails spuriously)."""
    results.mkdir(parents=True, exist_ok=True)
    print("| mix | loaded | vLLM's kernels |\n| --- | --- | --- |")
    for ckpt in sorted(p for p in folder.iterdir() if p.is_dir()):
        log = results / f"{ckpt.name}.log"
        with log.open("w") as f:
            rc = subprocess.run([sys.executable, "-c", LOAD, str(ckpt), str(memory)], stdout=f,
                                stderr=subprocess.STDOUT, timeout=300).returncode
        text = log.read_text()
        kernels = sorted(set(re.findall(r"Using (\w+LinearKernel) for", text))
                         | set(re.findall(r"CutlassFP8ScaledMMLinearKernel", text)))
        error = next((line.strip() for line in text.splitlines() if "Error:" in line), "")
        print(f"| {ckpt.name} | {'yes' if rc == 0 and 'RESULT' in text else 'no: ' + error[:160]} | "
              f"{'; '.join(kernels) or '-'} |")


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "make":
        make(Path(sys.argv[2]))
    elif len(sys.argv) >= 4 and sys.argv[1] == "load":
        load(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
