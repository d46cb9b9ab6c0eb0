source bench/compare/setup.sh
TESTS="test/test_ops_cuda.py"
TORCH_CE_GPU_WORLD=2 timeout 120 python3 -m pytest -q -p no:cacheprovider $TESTS > $OUT/gpu_tests_ops_w2.log 2>&1; echo "w2 rc=$?" >> $OUT/gpu_tests_ops_w2.log
mkdir -p $OUT/new_w2 $OUT/base_w2
timeout 170 python3 -m torch_ce.cli bench ops --nprocs 2 --out $OUT/new_w2 > $OUT/new_w2/bench_ops.log 2>&1; echo "new ops w2 rc=$?"
(cd .base && PYTHONPATH=$PWD:$PYTHONPATH timeout 110 python3 -m torch_ce.cli bench ops --nprocs 2 --out $OUT/base_w2 > $OUT/base_w2/bench_ops.log 2>&1; echo "base ops w2 rc=$?")
python3 -m torch_ce.cli bench plot-scaling --results $OUT/new_w2 > /dev/null 2>&1
echo "===== tests"; grep -E "passed|failed|rc=" $OUT/gpu_tests_ops_w*.log
echo "===== new w2"; tail -32 $OUT/new_w2/bench_ops.log
echo "===== base w2"; tail -22 $OUT/base_w2/bench_ops.log
cd $OUT && tar czf ops_results.tgz new_w2 base_w2 gpu_tests_ops_w*.log && rm -rf new_w2 base_w2 gpu_tests_ops_w*.log; ls -la $OUT
