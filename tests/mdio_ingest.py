"""Ingest a post-stack 3D SEG-Y into MDIO v1 with the official `multidimio` library (test-only).
    python tests/mdio_ingest.py IN.sgy OUT.mdio [inline_byte crossline_byte]
segy_to_mdio starts worker processes, so it must run under `if __name__ == "__main__"`: the tests call this
script as a subprocess."""
import sys

if __name__ == "__main__":
    import mdio
    from mdio.builder.template_registry import get_template
    from segy.schema import HeaderField
    from segy.standards import get_segy_standard

    src, dst = sys.argv[1], sys.argv[2]
    il, xl = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (189, 193)
    spec = get_segy_standard(1.0).customize(trace_header_fields=[
        HeaderField(name="inline", byte=il, format="int32"), HeaderField(name="crossline", byte=xl, format="int32")])
    mdio.segy_to_mdio(segy_spec=spec, mdio_template=get_template("PostStack3DTime"), input_path=src,
                      output_path=dst, overwrite=False)
