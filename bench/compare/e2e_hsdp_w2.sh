source bench/compare/setup.sh
timeout 60 torchrun --nproc_per_node 2 test/gpu/run_hsdp_gpu.py > $OUT/hsdp_gpu.log 2>&1; echo "hsdp cold rc=$?" >> $OUT/hsdp_gpu.log
timeout 60 torchrun --nproc_per_node 2 test/gpu/run_hsdp_gpu.py >> $OUT/hsdp_gpu.log 2>&1; echo "hsdp warm rc=$?" >> $OUT/hsdp_gpu.log
grep -E "PASS|FAIL|rc=" $OUT/hsdp_gpu.log | tail -24
mkdir -p $OUT/base_w2 $OUT/new_w2
(cd .base && PYTHONPATH=$PWD:$PYTHONPATH timeout 150 python3 -m torch_ce.cli bench e2e --nprocs 2 --out $OUT/base_w2 --variants nccl,ce,bound --iters 20 > $OUT/base_w2/bench_e2e.log 2>&1; echo "base e2e w2 rc=$?")
timeout 150 python3 -m torch_ce.cli bench e2e --nprocs 2 --out $OUT/new_w2 --variants nccl,ce,bound --iters 20 > $OUT/new_w2/bench_e2e.log 2>&1; echo "new e2e w2 rc=$?"
echo "===== base w2"; tail -14 $OUT/base_w2/bench_e2e.log
echo "===== new w2"; tail -14 $OUT/new_w2/bench_e2e.log
cd $OUT && tar czf e2e_results2.tgz new_w2 base_w2 && rm -rf new_w2 base_w2; ls -la $OUT
