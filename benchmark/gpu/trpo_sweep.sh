# Device call 2: reassemble the SmolLM2 file, convert it once, run P and R seeds from 5 up, as many as fit, stop the
# harness before the deadline, pack the run folders (no .pt files) into $OUT.
T0=$(date +%s); WALL=${WALL:-540}; T=${TMPDIR:-/tmp}
source benchmark/gpu/device_setup.sh || exit 1
python3 -c "import trpo_gpt2_halfcheetah as t; print(t.smollm2_folder())" || exit 1
echo "converted after $(( $(date +%s) - T0 )) s"
N=${N:-$(python3 benchmark/gpu/trpo_sweep_choose.py $T0 $WALL)}
echo "runs at once: $N"
[ "$N" -gt 0 ] || exit 1
command -v git >/dev/null || { mkdir -p $T/gitbin && cp benchmark/gpu/git_stand_in.py $T/gitbin/git && export PATH=$T/gitbin:$PATH; echo "no git here: benchmark/gpu/git_stand_in.py stands in (COMMIT=$COMMIT)"; }
SEEDS=${SEEDS:-$(seq 5 $((4 + N / 2)))}; SETTINGS=${SETTINGS:-pretraining-smollm2-2blocks-pretrained-eval pretraining-smollm2-2blocks-random-eval}
python3 benchmark/run.py --scripts trpo_gpt2_halfcheetah --envs HalfCheetah-v5 --workers $N --runs-dir $T/runs \
  --settings $SETTINGS --seeds $SEEDS > $OUT/harness.log 2>&1 &
H=$!
while kill -0 $H 2>/dev/null; do
  if [ $(date +%s) -gt $((T0 + WALL - 10)) ]; then echo "deadline: stopping the harness"; kill -INT $H; wait $H; break; fi
  sleep 3
done
echo "harness done after $(( $(date +%s) - T0 )) s"; ls $T/runs/*/done.json 2>/dev/null | wc -l
tail -3 $T/runs/*/run.log | cut -c1-200
tar czf $OUT/gpu_runs.tgz --exclude='*.pt' -C $T runs; ls -la $OUT
