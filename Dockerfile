# The image the manifests in deploy/kubernetes/ run: nexus-serving:0.1.0-cpu or nexus-serving:0.1.0-cuda.
#
#   docker build --build-arg VARIANT=cpu  -t nexus-serving:0.1.0-cpu  .
#   docker build --build-arg VARIANT=cuda -t nexus-serving:0.1.0-cuda .
#
# VARIANT=cpu installs onnxruntime, VARIANT=cuda installs onnxruntime-gpu with the CUDA and cuDNN
# libraries as wheels (the host needs only the NVIDIA driver and container toolkit); never both, which
# the build checks. TORCH=1 adds the torch extra (torch==2.13.0 as pinned in pyproject.toml; only for
# PyTorch model files; ONNX models need none). BASE_IMAGE may be any Debian-based image: one without
# python3 (such as a minbase bootstrap) gets Debian's python3 and python3-venv.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS python
# Where the build host mounts its own /etc/ssl/certs read-only (for pip behind a proxy), the
# ca-certificates package cannot write its bundle there: its hook is then skipped for the install.
RUN if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
        set -e; \
        if ! touch /etc/ssl/certs/.writable 2>/dev/null; then \
            dpkg-divert --local --rename --add /usr/sbin/update-ca-certificates; \
            ln -s /bin/true /usr/sbin/update-ca-certificates; \
        fi; \
        rm -f /etc/ssl/certs/.writable; \
        apt-get update; \
        apt-get install -y --no-install-recommends python3 python3-venv ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
        if [ -L /usr/sbin/update-ca-certificates ]; then \
            rm /usr/sbin/update-ca-certificates; \
            dpkg-divert --local --rename --remove /usr/sbin/update-ca-certificates; \
        fi; \
    fi

FROM python AS build
ARG VARIANT=cpu
ARG TORCH=
WORKDIR /src
COPY pyproject.toml ./
COPY deploy/docker/requirements.py deploy/docker/requirements.py
# Dependencies first (a layer that survives source edits); the project itself with --no-deps, so that
# its `onnxruntime` requirement never pulls the CPU runtime into the cuda variant.
RUN python3 -m venv /opt/nexus \
    && python3 deploy/docker/requirements.py "$VARIANT" ${TORCH:+--torch} > /tmp/requirements.txt \
    && /opt/nexus/bin/pip install --no-cache-dir --disable-pip-version-check -r /tmp/requirements.txt
COPY common common
COPY frontend frontend
COPY backend backend
COPY globalsched globalsched
COPY profiler profiler
COPY nexus nexus
RUN /opt/nexus/bin/pip install --no-cache-dir --disable-pip-version-check --no-deps . \
    && /opt/nexus/bin/python deploy/docker/requirements.py --check "$VARIANT" \
    && /opt/nexus/bin/nexus --help > /dev/null

FROM python AS runtime
ARG VARIANT=cpu
# A fixed non-root user (the manifests' runAsUser); written directly, as minbase has no useradd.
RUN echo "nexus:x:10001:10001:nexus:/home/nexus:/usr/sbin/nologin" >> /etc/passwd \
    && echo "nexus:x:10001:" >> /etc/group \
    && mkdir -p /home/nexus /data \
    && chown 10001:10001 /home/nexus /data
COPY --from=build /opt/nexus /opt/nexus
ENV PATH=/opt/nexus/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/nexus \
    MPLCONFIGDIR=/tmp/matplotlib \
    NEXUS_IMAGE_VARIANT=${VARIANT}
USER 10001:10001
WORKDIR /home/nexus
# scheduler 8100, frontend gRPC 8001 (HTTP 8000), backend 9000 (metrics 9090)
EXPOSE 8100 8001 8000 9000 9090
ENTRYPOINT ["nexus"]
CMD ["--help"]
