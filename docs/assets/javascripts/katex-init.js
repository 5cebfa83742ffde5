// Typeset the math that pymdownx.arithmatex marks, on every page that
// Material's instant navigation loads (document$ fires for each one).
document$.subscribe(({ body }) => {
  body.querySelectorAll(".arithmatex").forEach((el) => {
    renderMathInElement(el, {
      delimiters: [
        { left: "\\[", right: "\\]", display: true },
        { left: "\\(", right: "\\)", display: false },
      ],
      throwOnError: false,
    });
  });
});
