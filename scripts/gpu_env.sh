# Sourced on the GPU host: the SGLang wheelhouse in /tmp/site (unpacked once per machine), this checkout
# importable as freekv_* without installing, and its plugin entry point visible to SGLang.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TVM_FFI_CACHE_DIR=/tmp/tvm-ffi-cache
unset TRITON_INTERPRET
if [ ! -d /tmp/site/sglang ] && [ -f .gpu-wheels/install.sh ]; then
  sh .gpu-wheels/install.sh /tmp/site >/dev/null || { echo "wheelhouse install failed" >&2; return 1; }
fi
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fkv-site .whl/*.whl
fi
mkdir -p /tmp/fkv-src/freekv_sglang-0.1.0.dist-info
for pair in freekv_sglang:freekv_sglang freekv_kernels:kernels freekv_kvstore:kvstore freekv_patches:patches; do
  ln -sfn "$PWD/${pair#*:}" "/tmp/fkv-src/${pair%%:*}"
done
printf 'Metadata-Version: 2.1\nName: freekv-sglang\nVersion: 0.1.0\n' >/tmp/fkv-src/freekv_sglang-0.1.0.dist-info/METADATA
python3 - >/tmp/fkv-src/freekv_sglang-0.1.0.dist-info/entry_points.txt <<'PY'
import tomllib
eps = tomllib.load(open("pyproject.toml", "rb"))["project"].get("entry-points", {})
for group, items in eps.items():
    print(f"[{group}]")
    for k, v in items.items():
        print(f"{k} = {v}")
PY
export PYTHONPATH=/tmp/fkv-src:/tmp/fkv-site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}

# A SmolLM2 server under the accuracy harness (the scripts add its flags): its 8K prompts fill the model's 8,192
# positions with the answer, and SGLang cuts max_new_tokens to its context length less 2, so it runs 2 tokens above
# it (no position reaches 8,192; the harness refuses an answer cut there). SGLang's own check against a context
# length above the model's is lifted for this server only.
SMOLLM2_SERVER=(env SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 python3 -m sglang.launch_server
                --model-path /tmp/smollm2 --context-length 8194)

wait_healthy() {  # NAME PORT PID LOG LIMIT_S: 0 once the server's /health answers; else its log's tail, its process
  local name=$1 port=$2 pid=$3 log=$4 limit=$5 t0  # group killed (it was started with setsid) and 1
  t0=$(date +%s)
  until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "$name: server exited"; tail -30 "$log"; return 1; }
    [ $(( $(date +%s) - t0 )) -lt "$limit" ] || { echo "$name: not healthy in $limit s"; tail -30 "$log"
                                                  kill -9 -- -"$pid"; return 1; }
    sleep 2
  done
  echo "$name healthy after $(( $(date +%s) - t0 )) s"
}
