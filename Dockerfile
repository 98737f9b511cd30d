# The rankscope image: one image for the collector and the dashboard (docker-compose.yml runs
# both from it). The entrypoint is the `rankscope` command, so the container's command is its
# arguments, e.g. `collector --clickhouse URL` or `dashboard --clickhouse URL`.
#
#   docker build -t rankscope .
#   docker build --build-arg TORCH=torch==2.11.0 -t rankscope .    # another torch version
#
# torch comes first, from PyTorch's CPU index: the package requires torch, and a bare `torch`
# requirement would pull a CUDA build of several gigabytes that neither service uses. Then the
# collector and dashboard extras (pyproject.toml): `pip install rankscope` alone is the agent.
FROM python:3.11-slim

ARG TORCH=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN pip install --index-url "$TORCH_INDEX" "$TORCH"

COPY . /src
RUN pip install "/src[collector,dashboard]" && rm -rf /src

# Neither service needs root; the dashboard's Streamlit writes its settings under $HOME.
RUN useradd --system --uid 10001 --create-home --home-dir /home/rankscope rankscope
USER rankscope
WORKDIR /home/rankscope

# 7777: gRPC (agents, rankscope sql/diagnose); 9464: the collector's Prometheus metrics; 8501: the dashboard
EXPOSE 7777 9464 8501
ENTRYPOINT ["rankscope"]
CMD ["--help"]
