"""Writes the Kubeflow pipeline YAML. The pipeline itself is generated from rlaif/graph.py in
rlaif/orchestration/kfp_pipeline.py; this script only compiles it (same as `rlaif compile kfp`).

    python pipelines/rlaif_pipeline.py --output pipelines/rlaif_pipeline.yaml [--cluster configs/cluster.yaml]
"""
import argparse

from rlaif.orchestration.kfp_pipeline import compile_pipeline

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="pipelines/rlaif_pipeline.yaml")
    parser.add_argument("--cluster", help="cluster settings YAML (images, GPUs, secrets)")
    parser.add_argument("--components-dir", default="components", help="where each stage's component.yaml goes")
    args = parser.parse_args()
    print(compile_pipeline(args.output, args.cluster, args.components_dir))
