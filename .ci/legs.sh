# shellcheck shell=bash
# CI's legs, sourced by .ci/run: one torch release each, in a fresh virtual environment in
# a temporary directory (no --system-site-packages, removed after the leg), in this checkout.
#
#   2.13    the README's two commands, verbatim (CPU wheel; csrc/ compile-checked by nvcc)
#   2.14.1  fast subset     \
#   2.11    fast subset      } the README's install with .ci/requirements-<leg>.txt in place
#   2.15    full default suite / of its `pip install torch==...` (CUDA wheels: csrc/ is built)
#
# Every leg's tests run with TORCH_CE_NO_SKIP (below): graph_trainer's test files may skip
# only for the reasons test/conftest.py allows.
#
# A leg other than the README's runs the README's install line in steps: its torch (the
# requirements file) and the line's other `pip install`s (not the demo: the README's leg
# runs it); then its tests. Every step prints its wall and CPU
# seconds; a failing leg does not stop the next; a summary of every leg closes the run, and
# CI fails if any leg failed (pytest's exit 5, no tests collected, is a failure). Each leg
# starts without the kernels a previous leg built into the tree
# (torch_ce/runtime/_ce_torch*.so, build/): they belong to that leg's torch.
#
# For trying the machinery by hand (CI sets none of these):
#   CE_CI_LEGS="2.15 2.11"          only these legs
#   CE_CI_TESTS="test/test_build.py"  every leg runs `python -m pytest -q` on these instead
#   CE_CI_VENVS=/work/venvs         each leg's venv is DIR/ci-<leg>, made anew and kept
#   CE_CI_BUDGET_S=5100             the run's deadline: a step still running then is stopped
#                                   (exit 124), a leg not yet started fails unrun

# The fast subset: FSDP2's gathers and reduce-scatter (the hooks may move between
# releases), the build, what torch_ce asks of this torch, graph_trainer's step (where
# it imports), the passes (goldens, rank independence, reorder), the
# no-hang fuzz, the uneven shards, the zoo's default case and weights that change (the
# protocol leans on DTensor version-counter behaviour that may move between releases).
FAST_TESTS="test/test_fsdp2_host.py test/test_fsdp2_reduce_scatter_host.py test/test_build.py test/test_torch_features.py test/test_graph_trainer.py test/test_passes_golden.py test/test_dim1_golden.py test/test_dim1_passes.py test/test_rank_independent.py test/test_reorder.py test/test_no_hang.py test/test_uneven_host.py test/test_zoo_matrix.py test/test_weight_updates_host.py test/test_write_paths_host.py"

# Slow cases the fast legs run all the same (test/conftest.py): the default suite leaves them
# out for its 15 minutes on 2 cores, and each runs on one fast leg, for CI's 90 minutes.
# 2.14.1: graph_trainer's step under full Inductor (Qwen3-MoE, one block; 2.11 cannot
# import graph_trainer). 2.11: Qwen3-MoE's experts on their own mesh at 4 ranks under
# weight updates, 200 graphs in one 4 GiB window, FSDP2's reduce-scatter under HSDP 2 x 2.
# Both: the zoo's default case (~100 s; it used to hang). 2.14.1: a diffusers Flux
# transformer's inference (~80 s).
# Both: torch_ce.fsdp2's gathers under HSDP 2 x 2, served over the shard dim (~25 s; 2.11's
# *fsdp2*hsdp* names it too).
SLOW_2141="*test_torch_ce_pipeline_against_default_slow*qwen3_moe-full-1block*,*test_zoo_case[[]*,*test_flux_inference*,*test_fsdp2_host.py::test_hsdp_2x2_serves_the_shard_dim"
SLOW_2111="*test_moe_experts_on_their_own_mesh*,*test_zoo_case[[]*,*test_200_graphs_bind_into_few_windows[[]4096*,*fsdp2*hsdp*"

# The copy-engine reduce-scatter's slow cases (issue 37), as node ids, shared out the same
# way: 2.14.1 EP at world 4, Qwen3-MoE at world 2 and graph_trainer under full Inductor;
# 2.11 HSDP 2x2, world 3 with uneven shards, Llama3 with bf16 param_dtype at world 2, and
# the op at world 4.
RS_TRAIN="test/test_reduce_scatter_training.py::test_trains_with_every_reduce_scatter_on_ce"
RS_2141="test/test_diffusers_host.py $RS_TRAIN[qwen3_moe-w4-ep] $RS_TRAIN[qwen3_moe-w2-fp32] test/test_reduce_scatter_graph_trainer.py::test_every_gradient_reduce_scatter_on_ce_full_inductor"
RS_211="test/test_pools.py::test_200_graphs_bind_into_few_windows $RS_TRAIN[qwen3_moe-w4-hsdp] $RS_TRAIN[llama3-w3-uneven] $RS_TRAIN[llama3-w2-bf16] test/test_reduce_scatter_host.py::test_protocol_with_a_late_rank[4]"
RS_SLOW="*test_reduce_scatter_*"

# Files none of whose default cases may skip where this leg's torch supports them
# (test/conftest.py: a skip for another reason than a slow case, no GPU or graph_trainer not
# importable on this torch, named, fails the tests step).
NO_SKIP="test_graph_trainer*.py,test_reduce_scatter_graph_trainer.py"

# name | what installs its torch (README: the README's own first command) | tests | the
# slow cases it runs all the same (TORCH_CE_RUN_SLOW)
LEGS=(
    "2.13|README|README|"
    "2.14.1|.ci/requirements-2.14.1.txt|$FAST_TESTS $RS_2141|$SLOW_2141,$RS_SLOW"
    "2.11|.ci/requirements-2.11.txt|$FAST_TESTS $RS_211|$SLOW_2111,$RS_SLOW"
    "2.15|.ci/requirements-2.15.txt|README|"
)

CI_START=$(date +%s)
CI_DEADLINE=$((CI_START + ${CE_CI_BUDGET_S:-5100}))
CI_SUMMARY=()
CI_FAILED=0
CI_TMPS=()

ci_cleanup() {
    if [ "${#CI_TMPS[@]}" -gt 0 ]; then rm -rf "${CI_TMPS[@]}"; fi
}

# ci_step LEG WHAT CMD: CMD in bash -euo pipefail, bounded by the deadline; sets STEP_RC,
# STEP_S (its wall seconds) and STEP_CPU (user + sys seconds of every process it waited for:
# on a machine others share, the wall time alone misleads; the tests' ranks, forked by
# multiprocessing's forkserver (test/mp_harness.py), are not among them), and prints them.
ci_step() {
    local leg=$1 what=$2 cmd=$3 left timing wall user sys TIMEFORMAT='%R %U %S'
    left=$((CI_DEADLINE - $(date +%s)))
    if [ "$left" -le 0 ]; then
        echo "ci: [$leg] $what: not run: past CI's deadline" >&2
        STEP_RC=124 STEP_S=0 STEP_CPU=0
        return
    fi
    echo "ci: [$leg] $what: $cmd"
    timing=$(mktemp)
    set +e
    { time timeout --kill-after=30 "$left" bash -euo pipefail -c "$cmd" 2>&3; } 3>&2 2>"$timing"
    STEP_RC=$?
    set -e
    read -r wall user sys <"$timing" || true
    rm -f "$timing"
    STEP_S=$(printf '%.0f' "${wall:-0}")
    STEP_CPU=$(awk -v u="${user:-0}" -v s="${sys:-0}" 'BEGIN { printf "%.0f", u + s }')
    if [ "$STEP_RC" -eq 124 ]; then echo "ci: [$leg] $what: stopped at CI's deadline" >&2; fi
    echo "ci: [$leg] $what: ${STEP_S} s wall, ${STEP_CPU} s CPU, exit $STEP_RC"
}

# What pip prints when a download, not the project, failed: a wheel cut short (its hash
# then differs from the index's), a dropped or timed-out connection.
CI_DOWNLOAD_FAILED='DO NOT MATCH THE HASHES|IncompleteRead|ProtocolError|ReadTimeoutError|Connection broken|Max retries exceeded'

# ci_install LEG CMD: the install step, tried again (up to 3 times in all, without pip's
# cache) only when pip says a download failed; any other failure stands at once. Sets
# STEP_RC, STEP_S and STEP_CPU as ci_step does (the seconds of every try).
ci_install() {
    local leg=$1 cmd=$2 try log s=0 c=0
    log=$(mktemp)
    for try in 1 2 3; do
        if [ "$try" -gt 1 ]; then
            echo "ci: [$leg] install: a download failed (pip: $(grep -oE "$CI_DOWNLOAD_FAILED" "$log" | head -n 1)); try $try of 3, without pip's cache" >&2
            export PIP_NO_CACHE_DIR=1
        fi
        ci_step "$leg" install "( $cmd ) 2>&1 | tee $log"
        s=$((s + STEP_S)) c=$((c + STEP_CPU))
        if [ "$STEP_RC" -eq 0 ] || [ "$STEP_RC" -eq 124 ] || ! grep -qE "$CI_DOWNLOAD_FAILED" "$log"; then break; fi
    done
    unset PIP_NO_CACHE_DIR
    rm -f "$log"
    STEP_S=$s STEP_CPU=$c
}

# ci_leg NAME TORCH TESTS README_INSTALL README_TEST: one leg, recorded in CI_SUMMARY.
ci_leg() {
    local name=$1 torch_req=$2 tests=$3 slow=$4 readme_install=$5 readme_test=$6
    local t0 tmp venv install run="" test_cmd result="" torch_v="-" i_s=- r_s=- t_s=- cpu=0 seg
    t0=$(date +%s)
    echo
    echo "ci: ===== leg $name ====="
    if [ "$torch_req" = README ]; then
        install=$readme_install
    else
        # The README's install line, split at `&&`: its torch pin is replaced by the leg's
        # requirements file, its other pip installs follow; the rest (the demo) runs on the
        # README's leg only (CI's 90 minutes: the suite runs the demo's code too).
        install="pip install -r $torch_req"
        while IFS= read -r seg; do
            case "$seg" in
                "pip install torch=="*) ;;
                "pip install "*) install+=" && $seg" ;;
                *) ;;
            esac
        done < <(printf '%s\n' "$readme_install" | sed 's/ *&& */\n/g')
    fi
    if [ -n "${CE_CI_TESTS:-}" ]; then
        test_cmd="python -m pytest -q $CE_CI_TESTS"
    elif [ "$tests" = README ]; then
        test_cmd=$readme_test
    else
        test_cmd="python -m pytest -q $tests"
    fi
    if [ -n "${CE_CI_VENVS:-}" ]; then
        venv="$CE_CI_VENVS/ci-$name"
        rm -rf "$venv"
    else
        tmp="$(mktemp -d "${TMPDIR:-/tmp}/torch_ce_ci.XXXXXX")"
        CI_TMPS+=("$tmp")
        venv="$tmp/venv"
    fi
    if [ "$(date +%s)" -ge "$CI_DEADLINE" ]; then
        result="not run: past CI's deadline"
    else
        rm -rf build torch_ce/runtime/_ce_torch*.so
        python3 -m venv "$venv"
        # shellcheck disable=SC1091
        . "$venv/bin/activate"
        echo "ci: [$name] fresh venv $VIRTUAL_ENV; python $(command -v python) ($(python --version 2>&1)), pip $(pip --version)"
        ci_install "$name" "$install"
        i_s=$STEP_S cpu=$((cpu + STEP_CPU))
        torch_v=$(python -c 'import torch; print(torch.__version__)' 2>/dev/null || echo "-")
        echo "ci: [$name] installed: $(pip list --format=freeze 2>/dev/null | tr '\n' ' ')"
        if [ "$STEP_RC" -ne 0 ]; then
            result="failed: install exit $STEP_RC"
        else
            if [ -n "$run" ]; then
                ci_step "$name" demo "$run"
                r_s=$STEP_S cpu=$((cpu + STEP_CPU))
                if [ "$STEP_RC" -ne 0 ]; then result="failed: demo exit $STEP_RC"; fi
            fi
            export TORCH_CE_NO_SKIP=$NO_SKIP
            if [ -n "$slow" ]; then export TORCH_CE_RUN_SLOW=$slow; fi
            ci_step "$name" tests "$test_cmd"
            unset TORCH_CE_NO_SKIP TORCH_CE_RUN_SLOW
            t_s=$STEP_S cpu=$((cpu + STEP_CPU))
            if [ "$STEP_RC" -eq 5 ]; then
                echo "ci: [$name] pytest collected no tests (exit 5): failing" >&2
                result="${result:+$result; }failed: no tests (pytest exit 5)"
            elif [ "$STEP_RC" -ne 0 ]; then
                result="${result:+$result; }failed: tests exit $STEP_RC"
            fi
        fi
        deactivate
        if [ -n "${tmp:-}" ]; then rm -rf "$tmp"; fi
    fi
    result=${result:-passed}
    if [ "$result" != passed ]; then CI_FAILED=$((CI_FAILED + 1)); fi
    CI_SUMMARY+=("$(printf '%-7s %-14s %8s %6s %7s %7s %7s  %s' "$name" "$torch_v" "$i_s" "$r_s" "$t_s" \
        "$(($(date +%s) - t0))" "$cpu" "$result")")
    echo "ci: ===== leg $name: $result, $(($(date +%s) - t0)) s ====="
}

# ci_legs README_INSTALL README_TEST: every leg (or those CE_CI_LEGS names), then the summary;
# returns 1 if any leg failed.
ci_legs() {
    local spec name torch_req tests slow
    trap ci_cleanup EXIT
    for spec in "${LEGS[@]}"; do
        IFS='|' read -r name torch_req tests slow <<<"$spec"
        if [ -n "${CE_CI_LEGS:-}" ] && [[ " $CE_CI_LEGS " != *" $name "* ]]; then continue; fi
        ci_leg "$name" "$torch_req" "$tests" "$slow" "$1" "$2"
    done
    echo
    echo "ci: summary (wall seconds, and the CPU seconds of the leg's steps; total $(($(date +%s) - CI_START)) s)"
    printf 'ci:   %-7s %-14s %8s %6s %7s %7s %7s  %s\n' leg torch install demo tests total cpu result
    printf 'ci:   %s\n' "${CI_SUMMARY[@]}"
    echo "ci: ${#CI_SUMMARY[@]} leg(s), $CI_FAILED failed"
    [ "$CI_FAILED" -eq 0 ]
}
