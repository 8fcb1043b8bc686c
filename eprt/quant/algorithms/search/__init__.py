"""The format search (--auto-quantize): the choice of a format per module group (`auto_quantize`),
its run (`auto_quantize_run`) and its pass (`passes`)."""
