"""The shipped kernel images at work: widgets in the default one, data-science packages in
the ``datascience`` recipe's (``build-image --recipe datascience``), through its shipped
kernelspec, in real gVisor kernels."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import docker
import pytest
from docker.errors import ImageNotFound
from jupyter_client.blocking.client import BlockingKernelClient

from sandbox_kernel.cli.app import RECIPE_LABEL, RECIPES, _recipe_digest
from sandbox_kernel.cli.resources import data_path
from sandbox_kernel.plan.settings import DATASCIENCE_IMAGE, DEFAULT_IMAGE

from .conftest import SANDBOX_UID, Execution, KernelStarter, run_ok

DATASCIENCE_KERNEL = RECIPES["datascience"].kernelspec
BUILD_DATASCIENCE = "jupyter sandbox-kernel build-image --recipe datascience --if-missing --debian-base"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def run_collecting(kc: BlockingKernelClient, code: str, timeout: float = 120) -> tuple[Execution, list[Any]]:
    """Execute ``code``: what it produced, and every IOPub message it caused (comms too)."""
    result = Execution()
    messages: list[dict[str, Any]] = []

    def hook(msg: dict[str, Any]) -> None:
        messages.append(msg)
        result.hook(msg)

    result.reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    assert result.status == "ok", f"cell failed: {result.outputs} {result.reply['content']}"
    return result, messages


# ---------------------------------------------------------------- default image: widgets


def test_a_slider_displays_and_opens_its_comm_in_the_default_image(start_kernel: KernelStarter) -> None:
    _, kc = start_kernel()
    code = (
        "import ipywidgets\n"
        "slider = ipywidgets.IntSlider(value=3, min=0, max=10, description='n')\n"
        "display(slider)\n"
        "print(slider.model_id)"
    )
    result, messages = run_collecting(kc, code)
    model_id = result.stdout.strip()
    assert result.stderr == ""

    (view,) = [out for out in result.outputs if out["type"] == "display_data"]
    assert view["data"][WIDGET_VIEW]["model_id"] == model_id

    opened = {m["content"]["comm_id"]: m["content"] for m in messages if m["msg_type"] == "comm_open"}
    assert model_id in opened, f"no comm_open for the slider on IOPub: {sorted(opened)}"
    assert opened[model_id]["target_name"] == "jupyter.widget"
    state = opened[model_id]["data"]["state"]
    assert (state["_model_name"], state["value"], state["max"]) == ("IntSliderModel", 3, 10)

    # The front end moves the slider: a comm_msg on shell reaches the kernel's widget.
    update = {"method": "update", "state": {"value": 7}, "buffer_paths": []}
    kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": model_id, "data": update}))
    assert run_ok(kc, "print(slider.value)").strip() == "7"


# ---------------------------------------------------------------- the data-science image

DATA_WORK = """
import duckdb, numpy as np, openpyxl, pandas as pd, polars as pl, pyarrow as pa, pyarrow.parquet as pq
import plotly.express as px, scipy.stats, seaborn as sns, sklearn, statsmodels.api as sm
from sklearn.linear_model import LinearRegression

rng = np.random.default_rng(0)
df = pd.DataFrame({"x": np.arange(20.0), "region": ["north", "south"] * 10})
df["y"] = 3 * df["x"] + 2 + rng.normal(0, 0.01, 20)

model = LinearRegression().fit(df[["x"]], df["y"])
print("sklearn", round(float(model.coef_[0]), 2), round(float(model.intercept_), 1))
print("statsmodels", round(float(sm.OLS(df["y"], sm.add_constant(df["x"])).fit().params["x"]), 2))
print("scipy", round(float(scipy.stats.pearsonr(df["x"], df["y"])[0]), 3))
rows = duckdb.sql("SELECT region, count(*) AS n FROM df GROUP BY region ORDER BY region").fetchall()
print("duckdb", rows)

pq.write_table(pa.Table.from_pandas(df), "frame.parquet")
back = pl.read_parquet("frame.parquet")
print("polars", back.height, back.filter(pl.col("region") == "north").height)
df.to_excel("frame.xlsx", index=False)
print("openpyxl", openpyxl.load_workbook("frame.xlsx").active.max_row)
sns.scatterplot(data=df, x="x", y="y", hue="region").figure.savefig("scatter.png")
px.scatter(df, x="x", y="y", color="region").show()
"""


@pytest.fixture
def datascience_kernel(jupyter_dirs: Path, docker_client: docker.DockerClient) -> str:
    """The shipped data-science kernelspec, installed where the test's Jupyter looks."""
    try:
        docker_client.images.get(DATASCIENCE_IMAGE)
    except ImageNotFound:
        pytest.fail(f"The data-science image {DATASCIENCE_IMAGE} is missing: run {BUILD_DATASCIENCE}")
    shutil.copytree(
        data_path("kernelspecs") / DATASCIENCE_KERNEL,
        jupyter_dirs / "kernels" / DATASCIENCE_KERNEL,
        dirs_exist_ok=True,
    )
    return DATASCIENCE_KERNEL


def test_the_datascience_image_builds_on_the_current_default_image(
    docker_client: docker.DockerClient,
) -> None:
    default = docker_client.images.get(DEFAULT_IMAGE)
    image = docker_client.images.get(DATASCIENCE_IMAGE)
    expected = _recipe_digest(data_path("images"), "datascience", default.id)
    assert image.labels[RECIPE_LABEL] == expected, (
        f"{DATASCIENCE_IMAGE} was not built from the current recipe on the current "
        f"{DEFAULT_IMAGE}: run {BUILD_DATASCIENCE}"
    )
    layers = image.attrs["RootFS"]["Layers"]
    assert layers[: len(default.attrs["RootFS"]["Layers"])] == default.attrs["RootFS"]["Layers"]
    config = image.attrs["Config"]
    assert config["User"] == "65533:65533"
    assert config["WorkingDir"] == "/workspace"
    assert config["Labels"]["io.sandbox-kernel.image"] == "python-datascience"


def test_a_datascience_kernel_does_real_work_in_its_workspace(
    start_kernel: KernelStarter, datascience_kernel: str, workspace: Path
) -> None:
    spec = json.loads((data_path("kernelspecs") / datascience_kernel / "kernel.json").read_text())
    assert spec["display_name"] == "Sandboxed Python (data science)"
    _, kc = start_kernel(datascience_kernel)

    identity = run_ok(kc, "import os, sys; print(os.getuid(), sys.prefix)").split()
    assert int(identity[0]) != 0
    assert identity[1] == "/opt/kernel"

    result, _ = run_collecting(kc, DATA_WORK)
    assert result.stderr == "", result.stderr  # joblib's semaphore warning included
    assert result.stdout.splitlines() == [
        "sklearn 3.0 2.0",
        "statsmodels 3.0",
        "scipy 1.0",
        "duckdb [('north', 10), ('south', 10)]",
        "polars 20 10",
        "openpyxl 21",
    ]
    figures = [out["data"] for out in result.outputs if out["type"] == "display_data"]
    plotly = [data for data in figures if "application/vnd.plotly.v1+json" in data]
    assert len(plotly) == 1
    assert {trace["name"] for trace in plotly[0]["application/vnd.plotly.v1+json"]["data"]} == {
        "north",
        "south",
    }
    assert any("image/png" in data for data in figures), "seaborn's figure was not shown"

    parquet = (workspace / "frame.parquet").read_bytes()
    assert parquet[:4] == parquet[-4:] == b"PAR1"
    with zipfile.ZipFile(workspace / "frame.xlsx") as xlsx:
        assert "xl/worksheets/sheet1.xml" in xlsx.namelist()
    assert (workspace / "scatter.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (workspace / "frame.parquet").stat().st_uid == (os.getuid() or SANDBOX_UID)
