"""lean_imports.skip_unused keeps scikit-learn, scipy.optimize (and, without CUDA, Triton) out of a
fresh process that imports what a run imports, and generation, masks and vLLM's import still work without them."""
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_process_imports_neither_sklearn_scipy_optimize_nor_triton_and_still_generates():
    code = textwrap.dedent("""
        import importlib.util, sys
        from plumbing import lean_imports
        lean_imports.skip_unused()
        import torch, accelerate, mlflow
        from transformers import Qwen2Config, Qwen2ForCausalLM
        import transformers.generation.utils
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1)).eval()
        out = model.generate(torch.tensor([[0, 1, 2]]), attention_mask=torch.tensor([[0, 1, 1]]), max_new_tokens=3,
                             do_sample=False, pad_token_id=0)
        assert out.shape == (1, 6), out.shape
        assert "sklearn" not in sys.modules, "sklearn imported"
        if not torch.cuda.is_available():
            assert sys.modules.get("triton", "absent") is None, "triton imported"
            assert importlib.util.find_spec("triton") is None   # what torch, Transformers and vLLM check
            import vllm   # vLLM's CPU build imports without Triton
        assert "scipy.optimize" not in sys.modules, "scipy.optimize imported"   # nor by vLLM's import
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_starting_the_mlflow_run_does_not_import_ipython(tmp_path):
    """MLflow's start_run asks whether it is in a notebook by importing IPython (1-2 s of every
    run); the Tracker starts the run without it, and the run still gets MLflow's source tags.
    Nor does it import wandb (half a second) unless W&B is asked for."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from plumbing.tracking import Tracker
        out = Path({str(tmp_path / "out")!r}); out.mkdir()
        (out / "config.yaml").write_text("a: 1\\n")
        tracker = Tracker(out, True, uri="sqlite:///{tmp_path}/mlflow.db", experiment="e", run_name="r",
                          params={{"a": 1}}, tags={{}}, datasets={{}}, log_model=False)
        tracker.finish("FINISHED", None)
        assert "IPython" not in sys.modules, "IPython imported"
        assert "wandb" not in sys.modules, "wandb imported by a run that did not ask for it"
        import mlflow
        tags = mlflow.MlflowClient("sqlite:///{tmp_path}/mlflow.db").get_run(tracker.run_id).data.tags
        assert tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.runName"] == "r", tags
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
