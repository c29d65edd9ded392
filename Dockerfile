# Fine-tuning recipes on a MUSA host (Moore Threads S4000 / S3000 / S80).
#
#   docker build -t musa-recipes .
#   docker run --rm -it --env MTHREADS_VISIBLE_DEVICES=all --shm-size 16g \
#       -v "$PWD/outputs:/app/outputs" -v "$HOME/.cache/huggingface:/home/recipes/.cache/huggingface" \
#       -e WANDB_API_KEY musa-recipes recipe=bert_squad
#
# CPU-only variant (no MUSA needed): docker build --build-arg BASE_IMAGE=python:3.11-slim \
#   --build-arg TORCH_SPEC="torch==2.7.1" -t musa-recipes:cpu .
ARG BASE_IMAGE=registry.mthreads.com/mcconline/musa-pytorch-release-public:latest
FROM ${BASE_IMAGE}

# Only used when the base image has no torch (the CPU variant); MUSA images bring torch and a
# matching torch_musa, which must stay exactly as they are.
ARG TORCH_SPEC="torch>=2.2"

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY recipes ./recipes
COPY conf ./conf
COPY scripts ./scripts
COPY train.py ./

# Pin whatever torch (and torch_musa) the image has as a constraint, so that no dependency can
# make pip replace them; install torch only when the base has none.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python -c "import torch" 2>/dev/null || python -m pip install "${TORCH_SPEC}"; \
    python -m pip freeze | grep -iE '^(torch|torch[-_]musa|torchvision|torchaudio)==' > /tmp/keep.txt || true; \
    python -m pip install -c /tmp/keep.txt . \
    && python -m pip freeze | grep -iE '^(torch|torch[-_]musa)==' | diff - <(grep -iE '^(torch|torch[-_]musa)==' /tmp/keep.txt) \
    && rm /tmp/keep.txt

# A non-root user where the base allows it; outputs and caches live in mounted folders.
RUN (useradd --create-home --uid 1000 recipes 2>/dev/null || true) \
    && mkdir -p /app/outputs && chown -R 1000:1000 /app
USER 1000
ENV HF_HOME=/home/recipes/.cache/huggingface

ENTRYPOINT ["python", "train.py"]
CMD ["recipe=bert_squad", "debug=smoke"]
